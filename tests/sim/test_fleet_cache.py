"""The fleet simulator's KV (`sim.fleet.cache.SimKV`) against the engine's own `BlockPool`.

A reference adapter drives the real `kv.block_pool.BlockPool` with the same operations the
simulator performs (lookup, allocate with hits, register computed blocks, free tail first);
random operation sequences must give the same hits, the same allocation answers, the same
cached hashes, the same free counts and the same KV events.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenmill.kv.block_pool import BlockPool, KVBlock
from tokenmill.kv.events import KVEventEmitter
from tokenmill.sim.fleet.cache import SeqBlocks, SimKV

BS = 4
NO_TOKENS: tuple[int, ...] = ()


@dataclass
class _RefSeq:
    hashes: tuple[int, ...]
    blocks: list[KVBlock] = field(default_factory=list)
    num_cached_blocks: int = 0


class _Reference:
    """KVCacheManager's rules over the real BlockPool, keyed by given hashes."""

    def __init__(self, num_blocks: int, events: KVEventEmitter) -> None:
        self.pool = BlockPool(num_blocks, BS, events)

    def cached_prefix(self, seq: _RefSeq, num_tokens: int) -> list[KVBlock]:
        hits = []
        for h in seq.hashes[:(num_tokens - 1) // BS]:
            block = self.pool.lookup(h, NO_TOKENS)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, seq: _RefSeq, total: int, hits: list[KVBlock]) -> bool:
        need = -(-total // BS) - len(seq.blocks) - len(hits)
        if need > self.pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0):
            return False
        self.pool.touch(hits)
        seq.blocks.extend(hits)
        if hits:
            seq.num_cached_blocks = len(seq.blocks)
        if need > 0:
            seq.blocks.extend(self.pool.allocate(need) or [])
        return True

    def cache_computed(self, seq: _RefSeq, computed: int) -> None:
        num_full = min(computed // BS, len(seq.blocks), len(seq.hashes))
        start = seq.num_cached_blocks
        if num_full <= start:
            return
        parent = seq.hashes[start - 1] if start else None
        self.pool.cache_blocks(seq.blocks[start:num_full], seq.hashes[start:num_full],
                               [NO_TOKENS] * (num_full - start), parent)
        seq.num_cached_blocks = num_full

    def free(self, seq: _RefSeq) -> None:
        self.pool.free(reversed(seq.blocks))
        seq.blocks, seq.num_cached_blocks = [], 0


def _chain(branch: list[int]) -> tuple[int, ...]:
    """A prompt's block hashes from a path in a small prefix tree (shared prefixes by construction)."""
    out, parent = [], 0
    for step in branch:
        parent = parent * 7 + step + 1
        out.append(parent)
    return tuple(out)


op = st.tuples(st.sampled_from(["admit", "compute", "free"]), st.integers(0, 5),
               st.lists(st.integers(0, 2), min_size=0, max_size=6), st.integers(1, 30))


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(4, 24), ops=st.lists(op, max_size=60))
# found by CI: freeing a sequence whose cached block another one still holds freed nothing of it
@example(num_blocks=4, ops=[("admit", 0, [1], 4), ("compute", 0, [], 1), ("admit", 1, [1], 5), ("free", 0, [], 1)])
def test_random_operations_match_the_engines_block_pool(num_blocks: int, ops: list) -> None:
    sim_events, ref_events = [], []
    e1, e2 = KVEventEmitter("w"), KVEventEmitter("w")
    e1.subscribe(sim_events.append)
    e2.subscribe(ref_events.append)
    sim, ref = SimKV(num_blocks, BS, e1), _Reference(num_blocks, e2)
    live: dict[int, tuple[SeqBlocks, _RefSeq, int]] = {}
    for kind, slot, branch, tokens in ops:
        if kind == "admit" and slot not in live:
            hashes = _chain(branch)[:tokens // BS]
            a, b = SeqBlocks(hashes), _RefSeq(hashes)
            hits_a, hits_b = sim.cached_prefix(a, tokens), ref.cached_prefix(b, tokens)
            assert hits_a == [blk.block_hash for blk in hits_b]
            ok_a, ok_b = sim.allocate(a, tokens, hits_a), ref.allocate(b, tokens, hits_b)
            assert ok_a == ok_b
            if ok_a:
                live[slot] = (a, b, tokens)
        elif kind == "compute" and slot in live:
            a, b, tokens = live[slot]
            sim.cache_computed(a, tokens)
            ref.cache_computed(b, tokens)
        elif kind == "free" and slot in live:
            a, b, _ = live.pop(slot)
            sim.free(a)
            ref.free(b)
        assert sim.num_free_blocks == ref.pool.num_free_blocks
        assert sorted(sim.cached_hashes()) == sorted(ref.pool.cached_hashes())
    assert sim_events == ref_events


def test_lru_evicts_the_least_recently_freed_and_keeps_hits() -> None:
    kv = SimKV(4, BS)
    first, second = SeqBlocks((1, 2)), SeqBlocks((3, 4))
    for seq in (first, second):
        assert kv.allocate(seq, 8)
        kv.cache_computed(seq, 8)
    kv.free(first)
    kv.free(second)
    third = SeqBlocks((5,))
    assert kv.allocate(third, 4)  # takes the front of the queue: block 2 of `first` (freed tail first)
    assert sorted(kv.cached_hashes()) == [1, 3, 4]
    assert kv.cached_prefix(SeqBlocks((3, 4)), 9) == [3, 4]
    assert kv.cached_prefix(SeqBlocks((1, 2)), 9) == [1]
    assert not kv.allocate(SeqBlocks((9, 9, 9, 9)), 16)  # 3 free blocks, 4 needed: nothing changes
    assert kv.num_free_blocks == 3


def test_a_preempted_sequence_finds_its_own_generated_blocks_again() -> None:
    """As in the engine, the blocks a request's output filled are cached, so recomputing it after a
    preemption hits them; the salt keeps them its own."""
    kv = SimKV(16, BS)
    seq = SeqBlocks([11, 12], salt=7)  # an 8-token prompt
    assert kv.allocate(seq, 14)
    kv.cache_computed(seq, 13)  # prompt + 5 generated tokens: blocks 0..2 are full
    assert len(seq.hashes) == 3 and seq.blocks[:3] == seq.hashes
    kv.free(seq)
    again = SeqBlocks(list(seq.hashes), salt=7)
    assert kv.cached_prefix(again, 14) == seq.hashes  # all three full blocks (never the last position)
    other = SeqBlocks([11, 12], salt=8)
    other.extend_generated(3)
    assert other.hashes[:2] == seq.hashes[:2] and other.hashes[2] != seq.hashes[2]


def test_reserved_blocks_are_not_allocated_to_others() -> None:
    kv = SimKV(4, BS)
    assert kv.reserve(3)
    assert not kv.reserve(2)
    assert not kv.allocate(SeqBlocks([]), 2 * BS)  # only one block is not promised
    assert kv.allocate(SeqBlocks([]), BS)
