import pytest

from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.cache_manager import KVCacheManager
from tokenmill.kv.events import AllCleared, BlockRemoved, BlockStored, KVEventEmitter, event_from_wire, event_to_wire


def _pool(n: int = 8, bs: int = 4) -> tuple[BlockPool, list]:
    events: list = []
    emitter = KVEventEmitter("w0")
    emitter.subscribe(events.append)
    return BlockPool(n, bs, emitter), events


def test_allocation_failure_is_none_and_changes_nothing() -> None:
    pool, _ = _pool(4)
    assert pool.allocate(5) is None
    assert pool.num_free_blocks == 4
    blocks = pool.allocate(4)
    assert blocks is not None and pool.num_free_blocks == 0 and pool.allocate(1) is None


def test_freed_cached_blocks_are_reusable_until_evicted_lru() -> None:
    pool, events = _pool(2, 4)
    kv = KVCacheManager(pool)
    toks = list(range(8))
    assert kv.allocate("a", 8, kv.find_cached_prefix("a", toks))
    kv.cache_computed("a", toks, 8)
    kv.free("a")
    assert pool.num_free_blocks == 2
    hit = kv.find_cached_prefix("b", toks + [9])
    assert hit.num_tokens == 8
    assert isinstance(events[0], BlockStored) and len(events[0].hashes) == 2
    kv.free("b")
    # Allocating without the prefix evicts the tail block first (children before parents).
    taken = pool.allocate(1)
    assert taken is not None
    assert isinstance(events[-1], BlockRemoved) and events[-1].hashes == (events[0].hashes[1],)
    assert kv.find_cached_prefix("c", toks + [9]).num_tokens == 4


def test_hash_collision_never_serves_other_tokens() -> None:
    pool, _ = _pool(4, 4)
    block = pool.allocate(1)
    assert block is not None
    pool.cache_blocks(block, [1234], [[1, 2, 3, 4]], None)
    assert pool.lookup(1234, [1, 2, 3, 4]) is block[0]
    assert pool.lookup(1234, [9, 9, 9, 9]) is None


def test_full_prompt_hit_still_leaves_one_token_to_compute() -> None:
    pool, _ = _pool(8, 4)
    kv = KVCacheManager(pool)
    toks = list(range(8))
    kv.allocate("a", 8, kv.find_cached_prefix("a", toks))
    kv.cache_computed("a", toks, 8)
    assert kv.find_cached_prefix("b", toks).num_tokens == 4


def test_double_free_is_an_error_and_reset_needs_an_idle_pool() -> None:
    pool, events = _pool(4)
    blocks = pool.allocate(1)
    assert blocks is not None
    assert not pool.reset_prefix_cache()
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert isinstance(events[-1], AllCleared)


def test_events_round_trip_the_wire_format_and_ids_increase() -> None:
    pool, events = _pool(4, 4)
    kv = KVCacheManager(pool)
    toks = list(range(12))
    kv.allocate("a", 12, kv.find_cached_prefix("a", toks))
    kv.cache_computed("a", toks, 8)
    kv.cache_computed("a", toks, 12)
    assert [e.event_id for e in events] == [0, 1]
    assert events[1].parent == events[0].hashes[-1]
    for e in events:
        assert event_from_wire(event_to_wire(e)) == e
    with pytest.raises(ValueError):
        event_from_wire({"kind": "stored", "worker": "w", "event_id": 1, "tier": "moon", "hashes": []})


def test_eviction_hook_sees_blocks_before_they_are_reused() -> None:
    seen: list[tuple[int, int | None, tuple[int, ...] | None]] = []
    pool = BlockPool(2, 4, on_evict=lambda blocks: seen.extend(
        (b.block_hash, b.parent_hash, b.token_ids) for b in blocks))
    kv = KVCacheManager(pool)
    toks = list(range(8))
    kv.allocate("a", 8, kv.find_cached_prefix("a", toks))
    kv.cache_computed("a", toks, 8)
    hashes = kv.block_hashes("a")
    kv.free("a")
    assert pool.allocate(2) is not None
    assert sorted(seen) == sorted([(hashes[0], None, (0, 1, 2, 3)), (hashes[1], hashes[0], (4, 5, 6, 7))])
    assert all(b.block_hash is None and b.parent_hash is None for b in pool.blocks)
