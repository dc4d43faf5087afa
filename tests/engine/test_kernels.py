"""The native decode-attention kernel against PyTorch's attention, and the fallback path."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.helpers import GREEDY, make_engine, prompts
from tokenmill.engine import kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_sdpa_on_scattered_blocks(dtype: torch.dtype) -> None:
    assert kernels.available()
    g = torch.Generator().manual_seed(0)
    kv_heads, group, dim, bs, num_blocks = 2, 3, 32, 4, 64
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=g).to(dtype)
    lens = [1, 5, 17, 40]
    perm = torch.randperm(num_blocks, generator=g)
    tables, offset = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[offset:offset + nb])
        offset += nb
    table = torch.zeros(len(lens), max(len(t) for t in tables), dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    q = torch.randn(len(lens), kv_heads * group, dim, generator=g).to(dtype)
    out = kernels.paged_decode_attention(q, cache[0], cache[1], table, torch.tensor(lens), dim ** -0.5)
    for i, n in enumerate(lens):
        ctx = cache.index_select(1, tables[i]).reshape(2, -1, kv_heads, dim)[:, :n].float().transpose(1, 2)
        ref = F.scaled_dot_product_attention(q[i].float()[None, :, None], ctx[0][None], ctx[1][None],
                                             enable_gqa=True)[0, :, 0]
        assert torch.allclose(out[i], ref, atol=1e-5 if dtype == torch.float32 else 1e-3)


def test_pytorch_fallback_generates_the_same_tokens(tiny_moe: Path) -> None:
    native = make_engine(tiny_moe)
    fallback = make_engine(tiny_moe)
    fallback.runner.native_decode = False
    batch = prompts(native, 5, seed=21)
    assert native.runner.native_decode
    assert native.generate(batch, GREEDY) == fallback.generate(batch, GREEDY)


@settings(max_examples=40, deadline=None)
@given(dim=st.sampled_from([8, 24, 36, 64, 80, 128]), group=st.integers(1, 5), kv_heads=st.integers(1, 3),
       bs=st.sampled_from([4, 16, 32]), lens=st.lists(st.integers(1, 90), min_size=1, max_size=4),
       sharp=st.sampled_from([1.0, 30.0]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_kernel_matches_sdpa_on_random_shapes(dim: int, group: int, kv_heads: int, bs: int, lens: list[int],
                                              sharp: float, dtype: torch.dtype, seed: int) -> None:
    """Head sizes on the vector path (multiples of 8) and off it (36); group sizes that leave an odd
    head; contexts that end mid-group of 8; `sharp` scores whose softmax underflows to 0 for most keys."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // bs) for n in lens]
    cache = torch.randn(2, sum(blocks) + 2, bs, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(sum(blocks) + 2, generator=g)
    tables = list(perm[:sum(blocks)].split(blocks))
    table = torch.zeros(len(lens), max(blocks), dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    q = (torch.randn(len(lens), kv_heads * group, dim, generator=g) * sharp).to(dtype)
    out = kernels.paged_decode_attention(q, cache[0], cache[1], table, torch.tensor(lens), dim ** -0.5)
    for i, n in enumerate(lens):
        ctx = cache.index_select(1, tables[i]).reshape(2, -1, kv_heads, dim)[:, :n].float().transpose(1, 2)
        ref = F.scaled_dot_product_attention(q[i].float()[None, :, None], ctx[0][None], ctx[1][None],
                                             enable_gqa=True)[0, :, 0]
        assert torch.allclose(out[i], ref, atol=1e-4, rtol=1e-4), (i, (out[i] - ref).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_shared_between_threads_give_the_same_outputs(dtype: torch.dtype) -> None:
    """Enough K/V (8 sequences up to 2,000 tokens) for the kernel to share sequences between
    threads: equal to the single-thread result bit for bit, and to PyTorch's attention."""
    g = torch.Generator().manual_seed(9)
    kv_heads, group, dim, bs = 4, 2, 64, 16
    lens = [2000, 1500, 1999, 17, 1024, 1800, 600, 2000]
    blocks = [-(-n // bs) for n in lens]
    cache = torch.randn(2, sum(blocks), bs, kv_heads, dim, generator=g).to(dtype)
    tables = list(torch.randperm(sum(blocks), generator=g).split(blocks))
    table = torch.zeros(len(lens), max(blocks), dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    q = torch.randn(len(lens), kv_heads * group, dim, generator=g).to(dtype)
    previous = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(kernels.paged_decode_attention(q, cache[0], cache[1], table, torch.tensor(lens), dim ** -0.5))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1])
    for i, n in enumerate(lens):
        ctx = cache.index_select(1, tables[i]).reshape(2, -1, kv_heads, dim)[:, :n].float().transpose(1, 2)
        ref = F.scaled_dot_product_attention(q[i].float()[None, :, None], ctx[0][None], ctx[1][None],
                                             enable_gqa=True)[0, :, 0]
        assert torch.allclose(outs[1][i], ref, atol=1e-4, rtol=1e-4)


@settings(max_examples=30, deadline=None)
@given(dim=st.sampled_from([36, 64]), group=st.integers(1, 4), kv_heads=st.integers(1, 3),
       seqs=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 6)), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_a_sequences_queries_read_together_equal_each_query_alone(dim: int, group: int, kv_heads: int,
                                                                   seqs: list[tuple[int, int]], dtype: torch.dtype,
                                                                   seed: int) -> None:
    """A decode and its drafts (Q queries at the end of one context, each one key shorter than the
    next) in one pass over the context: bit for bit what each query gives alone, on the vector
    path (64) and off it (36)."""
    g = torch.Generator().manual_seed(seed)
    bs = 16
    seqs = [(max(n, q), q) for n, q in seqs]  # no more queries than context
    blocks = [-(-n // bs) for n, _ in seqs]
    cache = torch.randn(2, sum(blocks), bs, kv_heads, dim, generator=g).to(dtype)
    table = torch.zeros(len(seqs), max(blocks), dtype=torch.long)
    for i, t in enumerate(torch.randperm(sum(blocks), generator=g).split(blocks)):
        table[i, :len(t)] = t
    queries = torch.tensor([q for _, q in seqs])
    q = torch.randn(int(queries.sum()), kv_heads * group, dim, generator=g).to(dtype)
    together = kernels.paged_decode_attention(q, cache[0], cache[1], table, torch.tensor([n for n, _ in seqs]),
                                              dim ** -0.5, queries)
    alone_table = table.repeat_interleave(queries, dim=0)
    alone_lens = torch.tensor([n - (nq - 1 - i) for n, nq in seqs for i in range(nq)])
    alone = kernels.paged_decode_attention(q, cache[0], cache[1], alone_table, alone_lens, dim ** -0.5)
    assert torch.equal(together, alone)


def test_queries_that_do_not_fit_their_sequences_are_refused() -> None:
    cache = torch.zeros(2, 2, 16, 1, 64)
    q, table, lens = torch.zeros(3, 2, 64), torch.zeros(2, 1, dtype=torch.long), torch.tensor([4, 2])
    for queries in ([2, 2], [3, 0], [0, 3]):  # 4 rows; a sequence of none; 3 queries on 2 keys
        with pytest.raises(ValueError, match="queries must number 3"):
            kernels.paged_decode_attention(q, cache[0], cache[1], table, lens, 0.125, torch.tensor(queries))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.paged_decode_attention(q, cache[0], cache[1], table, lens, 0.125)
    assert kernels.paged_decode_attention(q, cache[0], cache[1], table, lens, 0.125, torch.tensor([1, 2])).shape == (3, 2, 64)
