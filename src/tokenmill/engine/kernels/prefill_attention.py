"""Prefill attention through `prefill_attention.c`: each sequence's new queries against its whole
cached context, flash-style over the paged K/V in place, all of a step's sequences in one call
(`prefill_attention_batch`, over a `SpanTable`), on `torch.get_num_threads()` threads;
`prefill_attention` is the same for one sequence.

`supported()` says where it runs (AVX2+FMA builds, head_dim a multiple of 16 up to 256, bf16
or fp32); elsewhere callers keep PyTorch's attention.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.kernels import MAX_HEAD_DIM, load_library

if TYPE_CHECKING:
    from tokenmill.engine.attention import SeqSpan

DTYPES = (torch.bfloat16, torch.float32)


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_library("prefill_attention.c")
    if lib is None:
        return None
    args = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    for name in ("tm_prefill_attention_batch_bf16", "tm_prefill_attention_batch_f32"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


@cache
def _vectorised() -> bool:
    """Whether this build has the kernel (probed once on a 1-token context)."""
    lib = _library()
    if lib is None:
        return False
    one = torch.zeros(1, 1, 1, 16)
    out = torch.empty(1, 1, 16)
    zero, ones = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    return lib.tm_prefill_attention_batch_f32(one.data_ptr(), one.data_ptr(), one.data_ptr(), zero.data_ptr(),
                                              zero.data_ptr(), ones.data_ptr(), ones.data_ptr(), out.data_ptr(),
                                              1, 1, 1, 1, 16, 1, 1.0, 1) == 0


def supported(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in DTYPES and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and _vectorised()


@dataclass(slots=True)
class SpanTable:
    """A step's spans in the kernel's form, built once per step (`of`) for all its layers."""
    block_table: torch.Tensor  # int64 [spans, max blocks], padded with 0
    query_starts: torch.Tensor  # int64 [spans]
    query_lens: torch.Tensor  # int64 [spans]
    context_lens: torch.Tensor  # int64 [spans]
    rows: int  # query rows the spans reach: the step's q must have at least these

    @staticmethod
    def of(spans: Sequence[SeqSpan], block_size: int) -> SpanTable:
        """ValueError for a span whose queries or context do not fit its blocks."""
        for s in spans:
            if not 0 < s.query_len <= s.context_len <= s.block_ids.numel() * block_size:
                raise ValueError(f"{s.query_len} queries on a context of {s.context_len} in "
                                 f"{s.block_ids.numel()} blocks")
        table = torch.zeros(len(spans), max(s.block_ids.numel() for s in spans), dtype=torch.int64)
        for i, s in enumerate(spans):
            table[i, :s.block_ids.numel()] = s.block_ids
        return SpanTable(table, torch.tensor([s.query_start for s in spans], dtype=torch.int64),
                         torch.tensor([s.query_len for s in spans], dtype=torch.int64),
                         torch.tensor([s.context_len for s in spans], dtype=torch.int64),
                         max(s.query_start + s.query_len for s in spans))


def prefill_attention_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans: SpanTable,
                            scale: float) -> torch.Tensor:
    """q [N, H, D]; k/v_cache [blocks, block_size, KVH, D] (contiguous, q's dtype); each span's
    query rows, the last of its context's positions, attend causally to that context -> [N, H, D]
    fp32, rows outside every span left uninitialised."""
    lib = _library()
    tokens, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if lib is None or not supported(q.dtype, dim) or k_cache.dtype != q.dtype or heads % kv_heads:
        raise ValueError(f"no prefill kernel for {q.dtype}, heads {heads}, kv heads {kv_heads}, head_dim {dim}")
    if spans.rows > tokens:
        raise ValueError(f"spans reach row {spans.rows} of a step of {tokens} query rows")
    fn = lib.tm_prefill_attention_batch_bf16 if q.dtype == torch.bfloat16 else lib.tm_prefill_attention_batch_f32
    q = q.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=torch.float32)
    count, width = spans.block_table.shape
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), spans.block_table.data_ptr(),
            spans.query_starts.data_ptr(), spans.query_lens.data_ptr(), spans.context_lens.data_ptr(), out.data_ptr(),
            count, width, heads, kv_heads, dim, block_size, scale, torch.get_num_threads())
    if rc == -2:
        raise ValueError("a span's queries or context do not fit its block table")
    if rc:
        raise MemoryError("native prefill attention could not allocate its scratch buffers")
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                      context_len: int, scale: float) -> torch.Tensor:
    """One sequence: q [Q, H, D] the last Q positions of `context_len`, over `block_ids` -> [Q, H, D] fp32."""
    from tokenmill.engine.attention import SeqSpan  # attention imports this module

    span = SeqSpan(0, q.shape[0], context_len, block_ids.to(torch.int64))
    return prefill_attention_batch(q, k_cache, v_cache, SpanTable.of([span], k_cache.shape[1]), scale)
