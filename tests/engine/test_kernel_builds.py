"""The native kernels give the same bits whatever the batch beside a row, whichever of their two
vector builds runs (AVX2, or AVX-512 where the CPU has it: each kernel sums every output in one
fixed order in both; on a CPU without AVX-512 both builds are the AVX2 one), and whichever
threads run them (torch's OpenMP pool, or threads of their own)."""
from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch

from tokenmill.engine import kernels
from tokenmill.engine.kernels import grouped_experts, prefill_attention

DTYPES = [torch.float32, torch.bfloat16]


def build_without_avx512(source_name: str, out_dir: Path) -> ctypes.CDLL:
    """The kernels of `source_name` as a CPU with AVX2 but no AVX-512 runs them."""
    return _build(source_name, out_dir / source_name.replace(".c", "-avx2.so"),
                  [*kernels._flags(source_name), *kernels._openmp_flags(), "-mno-avx512f"])


def _build(source_name: str, out: Path, flags: list[str]) -> ctypes.CDLL:
    kernels._compile(shutil.which("cc") or "gcc", flags, Path(kernels.__file__).with_name(source_name), out)
    return ctypes.CDLL(str(out))


def _linear_with(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    fn = getattr(lib, "tm_linear_bf16" if packed.dtype == torch.bfloat16 else "tm_linear_f32")
    fn.argtypes, fn.restype = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4, ctypes.c_int
    y = torch.empty(x.shape[0], out_features)
    assert fn(x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], out_features, 2) == 0
    return y


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_sums_depend_neither_on_the_rows_beside_it_nor_on_avx512(dtype: torch.dtype, tmp_path) -> None:
    """Rows share passes over a panel in groups (6 with AVX2, 16 with AVX-512), yet every row is
    summed in one order: alone, in any batch and in either build, its result is the same bit for
    bit. (On a CPU without AVX-512 both builds are the AVX2 one.)"""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(30, 200, generator=g)
    weight = (torch.randn(70, 200, generator=g) / 10).to(dtype)
    packed = grouped_experts.pack_panels(weight)
    alone = torch.cat([grouped_experts.linear(x[r:r + 1], packed, 70) for r in range(30)])
    for rows in (1, 5, 6, 7, 11, 12, 15, 16, 17, 25, 30):
        assert torch.equal(grouped_experts.linear(x[:rows], packed, 70), alone[:rows]), rows
    assert torch.equal(_linear_with(build_without_avx512("grouped_experts.c", tmp_path), x, packed, 70), alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_gives_the_same_bits_with_and_without_avx512(dtype: torch.dtype, tmp_path) -> None:
    g = torch.Generator().manual_seed(12)
    blocks, block_size, kv_heads, heads, dim, context, queries = 12, 16, 2, 6, 64, 150, 40
    k, v = (torch.randn(blocks, block_size, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(queries, heads, dim, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g)[:10].to(torch.int64).contiguous()
    native = prefill_attention.prefill_attention(q, k, v, table, context, 0.125)
    lib = build_without_avx512("prefill_attention.c", tmp_path)
    fn = lib.tm_prefill_attention_batch_bf16 if dtype == torch.bfloat16 else lib.tm_prefill_attention_batch_f32
    fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    starts, lens, contexts = (torch.tensor([n], dtype=torch.int64) for n in (0, queries, context))
    out = torch.empty(queries, heads, dim)
    assert fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), starts.data_ptr(), lens.data_ptr(),
              contexts.data_ptr(), out.data_ptr(), 1, table.numel(), heads, kv_heads, dim, block_size, 0.125, 2) == 0
    assert torch.equal(out, native)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_build_without_openmp_threads_its_own_way_to_the_same_bits(dtype: torch.dtype, tmp_path) -> None:
    """Where torch is not on GNU OpenMP the kernels start threads of their own (pthreads, a share
    of 2 MB each): a weight of 4-8 MB is then split between two of them, with the same sums."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(12, 512, generator=g)
    weight = (torch.randn(4096, 512, generator=g) / 20).to(dtype)
    packed = grouped_experts.pack_panels(weight)
    lib = _build("grouped_experts.c", tmp_path / "grouped_experts-pthreads.so", kernels._flags("grouped_experts.c"))
    assert torch.equal(_linear_with(lib, x, packed, 4096), grouped_experts.linear(x, packed, 4096))


def test_the_kernels_share_torchs_libgomp() -> None:
    """Built with -fopenmp where torch runs on GNU OpenMP, and bound to the very libgomp torch
    loaded: the process has one OpenMP pool, not two competing for the cores."""
    assert kernels.available() and grouped_experts.available(torch.float32)
    assert prefill_attention.supported(torch.float32, 64)
    assert kernels._openmp_flags() == ["-fopenmp"]  # torch's CPU wheel runs on GNU OpenMP
    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "/libgomp" in line}
    assert len(loaded) == 1 and Path(next(iter(loaded))).parent == Path(torch.__file__).parent / "lib", loaded
