"""Random allocate/compute/free sequences keep the pool's invariants."""
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.cache_manager import KVCacheManager

ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 5), st.integers(1, 40)),
               max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_reference_counts_match_live_block_tables(operations) -> None:
    pool = BlockPool(12, 4)
    kv = KVCacheManager(pool)
    tokens: dict[str, list[int]] = {}
    for op, rid_n, n in operations:
        rid = f"r{rid_n}"
        if op == "add" and rid not in tokens:
            toks = [rid_n % 3] * n  # few distinct prefixes, so hits happen
            if kv.allocate(rid, n, kv.find_cached_prefix(rid, toks)):
                tokens[rid] = toks
                kv.cache_computed(rid, toks, n)
            else:
                kv.free(rid)
        elif op == "grow" and rid in tokens:
            new_len = len(tokens[rid]) + n
            if kv.allocate(rid, new_len):
                tokens[rid] += [7] * n
                kv.cache_computed(rid, tokens[rid], new_len)
        elif op == "free" and rid in tokens:
            kv.free(rid)
            del tokens[rid]
        refs = [0] * pool.num_blocks
        for r in tokens:
            for b in kv.block_ids(r):
                refs[b] += 1
        assert [b.ref_cnt for b in pool.blocks] == refs
        assert pool.num_free_blocks == sum(1 for c in refs if c == 0)
        assert all(pool.cached[b.block_hash] is b for b in pool.blocks if b.block_hash is not None)
    for r in list(tokens):
        kv.free(r)
    assert pool.num_free_blocks == pool.num_blocks
