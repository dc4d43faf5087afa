"""Prefill attention paths against an explicit-mask reference on scattered blocks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.engine.attention import AttentionBatch, SeqSpan, allocate_kv_cache, paged_attention
from tokenmill.engine.kernels import prefill_attention


def _reference(q: torch.Tensor, kv: torch.Tensor, span: SeqSpan, scale: float) -> torch.Tensor:
    """Every query row against its visible keys, in fp32 with an explicit mask."""
    blocks = kv.index_select(1, span.block_ids).float()
    _, nb, bs, h, d = blocks.shape
    k, v = blocks.view(2, nb * bs, h, d)[:, :span.context_len].transpose(1, 2)
    rows = q[span.query_start:span.query_start + span.query_len].float().transpose(0, 1)
    pos = torch.arange(span.query_len).unsqueeze(1) + span.context_len - span.query_len
    mask = torch.arange(span.context_len).unsqueeze(0) <= pos
    out = F.scaled_dot_product_attention(rows[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(span.query_len, -1)


@pytest.mark.parametrize("native", [False, True], ids=["pytorch", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cold_and_cached_context_spans_match_the_masked_reference(dtype: torch.dtype, native: bool) -> None:
    """A cold prompt (query == context: the is_causal path in PyTorch) and a suffix over cached
    context (explicit mask), batched in one step, each equal the explicit-mask reference, through
    PyTorch's attention and through the native prefill kernel."""
    assert prefill_attention.supported(dtype, 16) or not native
    g = torch.Generator().manual_seed(0)
    kv_heads, heads, dim, bs = 2, 6, 16, 4
    kv = allocate_kv_cache(1, 40, bs, kv_heads, dim, dtype)[0]
    kv.copy_(torch.randn(kv.shape, generator=g).to(dtype))
    perm = torch.randperm(40, generator=g)
    cold = SeqSpan(0, 23, 23, perm[:6])
    cached = SeqSpan(23, 9, 57, perm[6:21])
    q = torch.randn(32, heads, dim, generator=g).to(dtype)
    batch = AttentionBatch(torch.zeros(32, dtype=torch.long), [cold, cached], native_prefill=native)
    out = paged_attention(q, kv, batch, dim ** -0.5).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for span in (cold, cached):
        got = out[span.query_start:span.query_start + span.query_len]
        assert torch.allclose(got, _reference(q, kv, span, dim ** -0.5), atol=tol)
