"""Native CPU kernels, compiled from C at first use and called through ctypes: paged decode
attention (here), flash-style prefill attention (`prefill_attention.py`) and small-M
expert/dense matmuls (`grouped_experts.py`).

Each shared library is built with the system C compiler into a per-user cache
keyed by the source's hash, so a changed kernel is rebuilt and concurrent
processes never load a half-written file. If no compiler is available the
engine falls back to its pure-PyTorch path (`available()` is False).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from tokenmill.engine.cpu_features import cpu_flags

log = logging.getLogger(__name__)

# Not -ffast-math: linking it sets flush-to-zero for the whole process. These allow what
# vectorises the reductions and expf (the kernel only ever sees finite values).
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math", "-ffinite-math-only", "-freciprocal-math", "-fPIC", "-shared", "-std=c11", "-pthread"]
# The kernels whose results must not depend on the batch (the batch-invariant path, --deterministic)
# keep their sums in the order written: with reassociation allowed, the compiler may add a row's
# terms in another order in each copy of a function inlined for a different row count. Their hot
# loops are vector intrinsics already, so this costs them nothing measurable.
_EXACT_SOURCES = frozenset({"prefill_attention.c", "grouped_experts.c"})
_EXACT_FLAGS = ["-fno-associative-math", "-fno-reciprocal-math"]
# the kernels' threads are torch's OpenMP pool (parallel.h); a compiler without OpenMP, or a torch on
# another OpenMP runtime than GNU's, gets kernels with threads of their own (see _openmp_flags)
_OPENMP_FLAGS = ["-fopenmp"]
MAX_HEAD_DIM = 256


def _cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_KERNEL_CACHE") or Path.home() / ".cache" / "tokenmill" / "kernels"
    return Path(root)


def _build(source_path: Path) -> Path:
    # the headers beside it count too: a changed header must rebuild every kernel
    source = b"".join(p.read_bytes() for p in [source_path, *sorted(source_path.parent.glob("*.h"))])
    # -march=native: a build is for this CPU's instructions (a cache shared between hosts must not
    # hand an AVX-512 build to a CPU without them)
    flags = _flags(source_path.name)
    build = " ".join([*flags, *_openmp_flags(), *sorted(cpu_flags())])
    digest = hashlib.sha256(source + build.encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source_path.stem}-{digest}.so"
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        try:
            _compile(compiler, [*flags, *_openmp_flags()], source_path, partial)
        except subprocess.CalledProcessError as exc:
            if not _openmp_flags():
                raise
            log.info("building %s without OpenMP: %s", source_path.name, exc.stderr.strip()[-500:])
            _compile(compiler, flags, source_path, partial)
        os.replace(partial, target)  # atomic: another process sees all of it or nothing
    log.info("built native kernel %s", target)
    return target


def _flags(source_name: str) -> list[str]:
    return [*_FLAGS, *_EXACT_FLAGS] if source_name in _EXACT_SOURCES else _FLAGS


@cache
def _openmp_flags() -> list[str]:
    """-fopenmp where torch runs on GNU OpenMP (its libgomp is loaded): the kernels, linked against
    the same soname, then share its pool. Another runtime (Intel's, LLVM's) would give the process
    a second pool competing with torch's for the cores: those kernels start threads of their own."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return _OPENMP_FLAGS if "/libgomp" in maps else []


def _compile(compiler: str, flags: list[str], source_path: Path, out: Path) -> None:
    subprocess.run([compiler, *flags, str(source_path), "-o", str(out), "-lm"], check=True, capture_output=True,
                   text=True)


def load_library(source_name: str) -> ctypes.CDLL | None:
    """The kernels of `source_name` (a .c file beside this one), built on first use; None when
    disabled (TOKENMILL_DISABLE_KERNELS) or when they cannot be built (the PyTorch path runs)."""
    if os.environ.get("TOKENMILL_DISABLE_KERNELS"):
        return None
    try:
        return ctypes.CDLL(str(_build(Path(__file__).with_name(source_name))))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native kernels of %s unavailable, using the PyTorch path: %s", source_name, detail)
        return None


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_library("paged_attention.c")
    if lib is None:
        return None
    args = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int]
    for name in ("paged_decode_attention_bf16", "paged_decode_attention_f32"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           queries: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D]; k/v_cache [blocks, block_size, KVH, D] (contiguous, same dtype as q);
    block_tables [B, max_blocks] int64; context_lens [B] int64 -> [N, H, D] float32.

    Without `queries` each row of q is one sequence's last query (N = B). With `queries` [B]
    int64, sequence b owns the next queries[b] rows (N = their sum), its last one at the end of
    its context_lens[b] keys and each before it one key shorter: a decode and its drafts read
    their context once. Sequences are shared out over `torch.get_num_threads()` threads."""
    lib = _library()
    if lib is None:
        raise RuntimeError("native kernels are not available")
    fn = {torch.bfloat16: lib.paged_decode_attention_bf16, torch.float32: lib.paged_decode_attention_f32}[q.dtype]
    n, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    b = context_lens.shape[0]
    if d > MAX_HEAD_DIM or h % kvh:
        raise ValueError(f"unsupported attention shape: heads {h}, kv heads {kvh}, head_dim {d}")
    if block_tables.shape[0] != b or (queries is None and b != n) or (queries is not None and queries.shape != (b,)):
        raise ValueError(f"{n} queries, {b} context lengths and {block_tables.shape[0]} block tables do not fit")
    q, block_tables, context_lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    if queries is not None:
        queries = queries.to(torch.int64).contiguous()
    out = torch.empty(n, h, d, dtype=torch.float32)
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
            None if queries is None else queries.data_ptr(), out.data_ptr(), n, b, h, kvh, d, bs,
            block_tables.shape[1], scale, torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"queries must number {n} in all, each sequence at least one and no more than its context")
    if rc != 0:
        raise MemoryError("native attention kernel could not allocate its scratch buffers")
    return out
