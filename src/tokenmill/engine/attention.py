"""Paged attention over the block-structured KV cache, in plain PyTorch.

KV cache layout, per layer: `[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`.
A block's K (or V) for one layer is one contiguous run of memory, which is what
the transfer library and the tiers copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.engine import kernels
from tokenmill.engine.huge_pages import empty_huge
from tokenmill.engine.kernels.prefill_attention import SpanTable, prefill_attention_batch


@dataclass(slots=True)
class SeqSpan:
    """One sequence's rows in a flattened step."""
    query_start: int
    query_len: int
    context_len: int  # tokens in the cache once this step's K/V are written
    block_ids: torch.Tensor  # int64, the blocks covering `context_len` tokens


@dataclass(slots=True)
class DecodeBatch:
    """Queries that each attend alone (a decode, and the drafts it verifies), read straight from
    the blocks. In the native kernel's form (`native`), sequence b's `queries[b]` rows are
    consecutive, the last at the end of its `context_lens[b]` keys, each before it one key
    shorter. In the row form (PyTorch's ops, `native` false) each row is its own entry: one
    block-table row, one context length, `queries` all 1."""
    rows: torch.Tensor  # int64 [n]: every query's row in the flattened step, ascending
    block_table: torch.Tensor  # int64 [entries, max_blocks], padded with 0
    context_lens: torch.Tensor  # int64 [entries]
    queries: torch.Tensor  # int64 [entries], summing to n
    native: bool = True


@dataclass(slots=True)
class AttentionBatch:
    slot_mapping: torch.Tensor  # int64 [tokens]: cache slot (block*block_size+offset) per new token
    spans: list[SeqSpan]  # sequences with several queries, or single ones without the decode kernel
    decode: DecodeBatch | None = None
    native_prefill: bool = False  # spans go through the flash-style kernel, not PyTorch's attention
    span_table: SpanTable | None = None  # the spans in that kernel's form: made at the first layer

    def native_spans(self, block_size: int) -> SpanTable:
        if self.span_table is None:
            self.span_table = SpanTable.of(self.spans, block_size)
        return self.span_table


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: str = "cpu",
) -> torch.Tensor:
    """One tensor for the whole cache: `[layers, 2, blocks, block_size, kv_heads, head_dim]`, zeroed
    (on huge pages where the host gives them: decode reads its blocks at scattered addresses)."""
    return empty_huge(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device).zero_()


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store this step's K/V ([tokens, kv_heads, head_dim]) at their slots."""
    _, nb, bs, h, d = kv_layer.shape
    kv_layer[0].view(nb * bs, h, d).index_copy_(0, slots, k)
    kv_layer[1].view(nb * bs, h, d).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, batch: AttentionBatch, scale: float
) -> torch.Tensor:
    """q: [tokens, heads, head_dim] -> [tokens, heads*head_dim], each row attending causally
    to its own sequence's cached context."""
    tokens, heads, dim = q.shape
    d = batch.decode
    if d is not None and not batch.spans and d.rows.numel() == tokens:  # rows 0..tokens-1: no gather
        return _decode_attention(q, kv_layer, d, scale).view(tokens, heads * dim)
    by_kernel = batch.native_prefill and q.is_cpu and bool(batch.spans)
    if by_kernel:  # every span in one call; the decode rows are filled in below
        spans = batch.native_spans(kv_layer.shape[2])
        out = prefill_attention_batch(q, kv_layer[0], kv_layer[1], spans, scale).to(q.dtype)
    else:
        out = q.new_empty(tokens, heads, dim)
    if d is not None:
        out.index_copy_(0, d.rows, _decode_attention(q.index_select(0, d.rows), kv_layer, d, scale))
    for span in [] if by_kernel else batch.spans:
        rows = slice(span.query_start, span.query_start + span.query_len)
        k, v = _gather_context(kv_layer, span)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, qlen, dim]
        if span.query_len == span.context_len and span.query_len > 1:
            # No cached context: the mask is the plain causal one, which the flash kernel
            # applies itself and uses to skip the key tiles above the diagonal (half the work
            # of a cold prompt), where an explicit mask would be computed through.
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = _causal_mask(span.query_len, span.context_len, q.device)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out.view(tokens, heads * dim)


def _decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, d: DecodeBatch, scale: float) -> torch.Tensor:
    if d.native:
        res = kernels.paged_decode_attention(q, kv_layer[0], kv_layer[1], d.block_table, d.context_lens, scale,
                                             d.queries)
        return res.to(q.dtype)
    return batched_decode_attention(q, kv_layer[0], kv_layer[1], d.block_table, d.context_lens, scale)


def batched_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                             context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, heads, dim], one query per row; k/v_cache [blocks, block_size, kv_heads, dim]: row i
    attends to the first context_lens[i] keys of the blocks block_table[i] (any block past those),
    -> [n, heads, dim]. PyTorch's ops, every shape fixed by q's and the table's: a CUDA graph
    captures it. It reads the table's whole width, masked. A KV head's query heads stand where
    a prompt's queries would (head h reads KV head h // group), so no KV is repeated per head and
    the masked, memory-efficient kernels take it (GQA's own flag is for unmasked attention)."""
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    width = block_table.shape[1] * block_size
    k = k_cache[block_table].view(n, width, kv_heads, dim).transpose(1, 2)  # [n, kv_heads, width, dim]
    v = v_cache[block_table].view(n, width, kv_heads, dim).transpose(1, 2)
    visible = torch.arange(width, device=q.device) < context_lens.unsqueeze(1)  # [n, width]
    out = F.scaled_dot_product_attention(q.view(n, kv_heads, heads // kv_heads, dim), k, v,
                                         attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(n, heads, dim)


def _gather_context(kv_layer: torch.Tensor, span: SeqSpan) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the span's context as [1, kv_heads, context_len, head_dim]."""
    n = span.context_len
    blocks = kv_layer.index_select(1, span.block_ids)  # [2, nb, bs, h, d]
    _, nb, bs, h, d = blocks.shape
    kv = blocks.view(2, nb * bs, h, d)[:, :n].transpose(1, 2)  # [2, h, n, d]
    return kv[0].unsqueeze(0), kv[1].unsqueeze(0)


def _causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """Query i (at absolute position context_len-query_len+i) sees keys 0..that position."""
    if query_len == 1:
        return None
    offset = context_len - query_len
    q_pos = torch.arange(query_len, device=device).unsqueeze(1) + offset
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    return k_pos <= q_pos
