"""The native RMSNorm and rotary-plus-KV-store against the PyTorch expressions they replace, in
both dtypes, on both vector builds, and whatever rows lie beside a row."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from tests.engine.test_kernel_builds import build_without_avx512
from tokenmill.engine.attention import write_kv
from tokenmill.engine.kernels import layer_ops
from tokenmill.engine.models.layers import apply_rotary

DTYPES = [torch.float32, torch.bfloat16]


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 3000])  # 3000 rows: shared between threads
def test_rms_norm_matches_pytorch(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    weight = torch.rand(576, generator=g).to(dtype) + 0.5
    out = layer_ops.rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    # only the sum of squares is added in another order: fp32 within rounding, bf16 within one step
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(out, torch_rms_norm(x, weight, 1e-5), **tol)


def test_rms_norm_of_a_row_is_the_same_alone_in_a_batch_and_without_avx512(tmp_path) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 200, generator=g)
    weight = torch.rand(200, generator=g)
    batch = layer_ops.rms_norm(x, weight, 1e-6)
    for r in (0, 17, 39):
        assert torch.equal(layer_ops.rms_norm(x[r:r + 1], weight, 1e-6)[0], batch[r])
    lib = build_without_avx512("layer_ops.c", tmp_path)
    lib.tm_rms_norm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int]
    out = torch.empty_like(x)
    assert lib.tm_rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), 40, 200, 1e-6, 2) == 0
    assert torch.equal(out, batch)


def test_rms_norm_refuses_a_weight_of_another_size() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        layer_ops.rms_norm(torch.randn(2, 8), torch.ones(6), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 600])
def test_rope_store_matches_apply_rotary_and_write_kv(dtype: torch.dtype, tokens: int) -> None:
    """q, k, v as the attention module has them: views of one projection's output."""
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim, blocks, block_size = 6, 2, 64, 100, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    expected_cache = torch.zeros(2, blocks, block_size, kv_heads, dim, dtype=dtype)
    q_ref, k_ref = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    write_kv(expected_cache, k_ref, v, slots)

    cache = torch.zeros_like(expected_cache)
    layer_ops.rope_store(q, k, v, cos, sin, cache[0], cache[1], slots)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(cache, expected_cache)


def test_rope_store_refuses_a_slot_outside_the_cache_and_changes_nothing() -> None:
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    cos, sin = torch.ones(2, 8), torch.zeros(2, 8)
    cache = torch.zeros(2, 3, 4, 2, 8)
    before = q.clone()
    with pytest.raises(IndexError, match="12 rows"):
        layer_ops.rope_store(q, k, v, cos, sin, cache[0], cache[1], torch.tensor([0, 12]))
    assert torch.equal(q, before) and not cache.any()
