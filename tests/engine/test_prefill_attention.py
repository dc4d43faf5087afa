"""The native flash-style prefill kernel against PyTorch's attention on random shapes, its
refusals, and the engine generating the same tokens with it and without it."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.helpers import GREEDY, make_engine, prompts
from tokenmill.engine.kernels import prefill_attention as kernel


def _reference(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, context: int) -> torch.Tensor:
    """q [Q, H, D] as the last Q positions of `context` keys, fp32, explicit causal mask."""
    qlen, _, dim = q.shape
    kv = cache.index_select(1, table).reshape(2, -1, cache.shape[3], dim)[:, :context].float().transpose(1, 2)
    pos = torch.arange(qlen).unsqueeze(1) + context - qlen
    mask = torch.arange(context).unsqueeze(0) <= pos
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], kv[0][None], kv[1][None],
                                         attn_mask=mask, scale=dim ** -0.5, enable_gqa=True)
    return out[0].transpose(0, 1)


@settings(max_examples=40, deadline=None)
@given(dim=st.sampled_from([16, 32, 64, 128]), group=st.integers(1, 5), kv_heads=st.integers(1, 3),
       bs=st.sampled_from([16, 32]), qlen=st.integers(1, 80), cached=st.integers(0, 300),
       sharp=st.sampled_from([1.0, 30.0]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_kernel_matches_sdpa_on_random_shapes(dim: int, group: int, kv_heads: int, bs: int, qlen: int, cached: int,
                                              sharp: float, dtype: torch.dtype, threads: int, seed: int) -> None:
    """Cold prompts (nothing cached) and new turns on cached context; query counts that leave a
    part-filled 6-row tile, contexts that end mid-chunk and mid-block; `sharp` queries whose softmax
    underflows to 0 for most keys; more threads than the work splits into."""
    assert kernel.supported(dtype, dim)
    g = torch.Generator().manual_seed(seed)
    context = cached + qlen
    blocks = -(-context // bs)
    cache = torch.randn(2, blocks + 3, bs, kv_heads, dim, generator=g).to(dtype)
    table = torch.randperm(blocks + 3, generator=g)[:blocks]
    q = (torch.randn(qlen, kv_heads * group, dim, generator=g) * sharp).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel.prefill_attention(q, cache[0], cache[1], table, context, dim ** -0.5)
    finally:
        torch.set_num_threads(previous)
    ref = _reference(q, cache, table, context)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()


def test_unsupported_shapes_and_inconsistent_spans_are_refused() -> None:
    q = torch.zeros(4, 2, 16)
    cache = torch.zeros(3, 16, 1, 16)
    table = torch.arange(3)
    assert not kernel.supported(torch.float32, 24)  # head_dim not a multiple of 16
    assert not kernel.supported(torch.float16, 64)
    with pytest.raises(ValueError, match="head_dim 24"):
        kernel.prefill_attention(torch.zeros(4, 2, 24), torch.zeros(3, 16, 1, 24), torch.zeros(3, 16, 1, 24),
                                 table, 10, 1.0)
    with pytest.raises(ValueError, match="4 queries on a context of 3"):
        kernel.prefill_attention(q, cache, cache, table, 3, 1.0)
    with pytest.raises(ValueError, match="context of 49 in 3 blocks"):
        kernel.prefill_attention(q, cache, cache, table, 49, 1.0)
    with pytest.raises(ValueError, match="kv heads 3"):
        kernel.prefill_attention(q, torch.zeros(3, 16, 3, 16), torch.zeros(3, 16, 3, 16), table, 10, 1.0)


def test_engine_generates_the_same_tokens_without_the_prefill_kernel(tiny_moe: Path) -> None:
    """Mixed prompt lengths, chunked prefill (chunks on cached context) and a shared prefix,
    with the kernel and with PyTorch's attention: the same greedy tokens."""
    native = make_engine(tiny_moe, max_num_batched_tokens=48)
    fallback = make_engine(tiny_moe, max_num_batched_tokens=48)
    fallback.runner.native_prefill = False
    assert native.runner.native_prefill
    batch = prompts(native, 5, seed=33)
    batch.append(batch[0] + batch[1])  # its first blocks are cached by then: a new turn
    assert native.generate(batch, GREEDY) == fallback.generate(batch, GREEDY)


@settings(max_examples=30, deadline=None)
@given(dim=st.sampled_from([16, 32, 64, 128, 256]), group=st.integers(1, 8), kv_heads=st.integers(1, 3),
       lens=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 150)), min_size=1, max_size=5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_a_row_is_the_same_bits_in_any_span_and_beside_any_sequences(
        dim: int, group: int, kv_heads: int, lens: list[tuple[int, int]], dtype: torch.dtype, threads: int,
        seed: int) -> None:
    """Several sequences (each `qlen` new queries on `cached` keys) in one call, against every
    query row computed alone as a one-query span at its own position: bitwise equal, for odd
    head groups too (a tile of 1, 3, 5 or 7 rows takes its own copy of the inner loops)."""
    from tokenmill.engine.attention import SeqSpan

    g, bs = torch.Generator().manual_seed(seed), 16
    spans, at, rows = [], 0, 0
    for qlen, cached in lens:
        blocks = -(-(qlen + cached) // bs)
        spans.append(SeqSpan(rows, qlen, qlen + cached, torch.arange(at, at + blocks)))
        at, rows = at + blocks, rows + qlen
    cache = torch.randn(2, at, bs, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(rows, kv_heads * group, dim, generator=g).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = kernel.prefill_attention_batch(q, cache[0], cache[1], kernel.SpanTable.of(spans, bs), 0.25)
        for s in spans:
            for i in range(s.query_len):
                row = s.query_start + i
                alone = kernel.prefill_attention(q[row:row + 1], cache[0], cache[1], s.block_ids,
                                                 s.context_len - s.query_len + i + 1, 0.25)
                assert torch.equal(alone[0], together[row]), (row, (alone[0] - together[row]).abs().max())
    finally:
        torch.set_num_threads(previous)


def test_spans_beyond_the_step_are_refused() -> None:
    from tokenmill.engine.attention import SeqSpan

    cache = torch.zeros(3, 16, 1, 16)
    spans = kernel.SpanTable.of([SeqSpan(2, 4, 10, torch.arange(3))], 16)
    with pytest.raises(ValueError, match="row 6 of a step of 5"):
        kernel.prefill_attention_batch(torch.zeros(5, 1, 16), cache, cache, spans, 1.0)
