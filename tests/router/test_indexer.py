"""KVIndexer: stored/removed/cleared, parent chaining, tiers, gaps and snapshots, workers leaving."""
from __future__ import annotations

import pytest

from tokenmill.kv.events import AllCleared, BlockRemoved, BlockStored
from tokenmill.router.indexer import ApplyStatus, KVIndexer


def test_stored_then_match_counts_leading_blocks_per_worker() -> None:
    index = KVIndexer()
    assert index.apply(BlockStored("a", "device", None, (1, 2, 3), 0)) is ApplyStatus.APPLIED
    assert index.apply(BlockStored("b", "device", None, (1, 2), 0)) is ApplyStatus.APPLIED
    assert index.match([1, 2, 3, 4]) == {"a": {"device": 3}, "b": {"device": 2}}
    assert index.match([9, 1, 2]) == {}
    assert index.match([]) == {}
    assert index.num_blocks() == 5 and index.num_hashes() == 3


def test_child_is_reached_only_through_its_parent() -> None:
    index = KVIndexer()
    index.apply(BlockStored("a", "device", None, (1, 2), 0))
    index.apply(BlockStored("a", "device", 2, (3, 4), 1))        # attaches under 2
    index.apply(BlockStored("a", "device", 77, (88, 99), 2))     # parent unknown: an orphan
    assert index.orphans == 1
    assert index.match([1, 2, 3, 4]) == {"a": {"device": 4}}
    assert index.match([1, 5, 3, 4]) == {"a": {"device": 1}}     # the walk stops at the missing block
    assert index.match([88, 99]) == {"a": {"device": 2}}


def test_restored_hashes_are_idempotent_and_removed_detaches() -> None:
    index = KVIndexer()
    index.apply(BlockStored("a", "device", None, (1, 2, 3), 0))
    index.apply(BlockStored("a", "device", None, (1, 2, 3, 4), 1))  # re-announces 1..3
    assert index.num_blocks() == 4
    index.apply(BlockRemoved("a", "device", (4, 3), 2))
    assert index.match([1, 2, 3, 4]) == {"a": {"device": 2}}
    index.apply(BlockRemoved("a", "device", (3, 42), 3))            # unknown hashes are ignored
    assert index.num_blocks() == 2


def test_removing_one_holder_keeps_the_others() -> None:
    index = KVIndexer()
    index.apply(BlockStored("a", "device", None, (1, 2), 0))
    index.apply(BlockStored("b", "device", None, (1, 2), 0))
    index.apply(BlockRemoved("a", "device", (2,), 1))
    assert index.match([1, 2]) == {"a": {"device": 1}, "b": {"device": 2}}
    assert index.num_hashes() == 2


def test_tiers_split_a_prefix_and_a_block_counts_in_its_preferred_tier() -> None:
    index = KVIndexer(tier_preference=("device", "host", "shared", "disk"))
    index.apply(BlockStored("a", "device", None, (1, 2), 0))
    index.apply(BlockStored("a", "host", 2, (3, 4), 1))
    index.apply(BlockStored("a", "host", None, (1,), 2))            # also in host: counted as device
    index.apply(BlockStored("a", "disk", 4, (5,), 3))
    index.apply(BlockStored("b", "shared", None, (1, 2, 3), 0))
    assert index.match([1, 2, 3, 4, 5, 6]) == {
        "a": {"device": 2, "host": 2, "disk": 1}, "b": {"shared": 3}}
    index.apply(BlockRemoved("a", "device", (1,), 4))               # still held in host
    assert index.match([1, 2, 3]) == {"a": {"host": 2, "device": 1}, "b": {"shared": 3}}


def test_cleared_drops_every_tier_of_that_worker_only() -> None:
    index = KVIndexer()
    index.apply(BlockStored("a", "device", None, (1, 2), 0))
    index.apply(BlockStored("a", "host", 2, (3,), 1))
    index.apply(BlockStored("b", "device", None, (1,), 0))
    index.apply(AllCleared("a", 2))
    assert index.match([1, 2, 3]) == {"b": {"device": 1}}
    assert index.worker_blocks("a") == {}


def test_remove_worker_drops_it_and_reuses_its_slot() -> None:
    index = KVIndexer()
    index.apply(BlockStored("a", "device", None, (1, 2), 0))
    index.apply(BlockStored("b", "device", None, (1, 2, 3), 0))
    index.remove_worker("a")
    index.remove_worker("nobody")
    assert index.match([1, 2, 3]) == {"b": {"device": 3}}
    assert index.workers() == ["b"]
    index.apply(BlockStored("c", "device", None, (1,), 0))           # takes a's freed slot
    assert index.match([1, 2, 3]) == {"b": {"device": 3}, "c": {"device": 1}}


def test_duplicate_ids_are_stale_and_id_zero_means_restart() -> None:
    index = KVIndexer()
    index.apply(BlockStored("a", "device", None, (1, 2), 0))
    index.apply(BlockStored("a", "device", 2, (3,), 1))
    assert index.apply(BlockRemoved("a", "device", (3,), 1)) is ApplyStatus.STALE
    assert index.match([1, 2, 3]) == {"a": {"device": 3}}
    assert index.apply(BlockStored("a", "device", None, (7,), 0)) is ApplyStatus.APPLIED  # restarted
    assert index.worker_blocks("a") == {"device": {7}}


def test_gap_asks_for_a_snapshot_and_buffered_events_are_replayed() -> None:
    index = KVIndexer()
    index.apply(BlockStored("a", "device", None, (1, 2), 0))
    # ids 1 and 2 are lost: they stored 3 and removed 2
    assert index.apply(BlockStored("a", "device", None, (10,), 3)) is ApplyStatus.GAP
    assert index.apply(BlockStored("a", "device", 10, (11,), 4)) is ApplyStatus.AWAITING_SNAPSHOT
    assert index.awaiting_snapshot() == ["a"] and index.gaps_detected == 1
    # the snapshot was taken after event 3, before event 4
    status = index.apply_snapshot("a", {"device": [1, 3, 10]}, last_event_id=3)
    assert status is ApplyStatus.APPLIED and index.gaps_recovered == 1
    assert index.worker_blocks("a") == {"device": {1, 3, 10, 11}}
    assert index.awaiting_snapshot() == [] and index.last_event_id("a") == 4
    assert index.apply(BlockRemoved("a", "device", (11,), 5)) is ApplyStatus.APPLIED


def test_snapshot_that_does_not_connect_to_the_buffer_asks_again() -> None:
    index = KVIndexer()
    index.apply(BlockStored("a", "device", None, (1,), 0))
    assert index.apply(BlockStored("a", "device", None, (5,), 4)) is ApplyStatus.GAP
    # a snapshot from before the gap (id 2) cannot be joined to event 4
    assert index.apply_snapshot("a", {"device": [1, 2]}, last_event_id=2) is ApplyStatus.GAP
    assert index.awaiting_snapshot() == ["a"]
    assert index.worker_blocks("a") == {"device": {1, 2, 5}}  # best effort meanwhile
    assert index.apply_snapshot("a", {"device": [1, 2, 5]}, last_event_id=4) is ApplyStatus.APPLIED
    assert index.gaps_recovered == 1


def test_first_event_of_an_unknown_worker_after_zero_is_a_gap() -> None:
    index = KVIndexer()
    assert index.apply(BlockStored("late", "device", None, (1,), 57)) is ApplyStatus.GAP
    assert index.apply_snapshot("late", {"device": [1, 2], "host": [3]}, 57) is ApplyStatus.APPLIED
    assert index.match([1, 2, 3]) == {"late": {"device": 2, "host": 1}}


def test_unrequested_old_snapshot_is_ignored() -> None:
    index = KVIndexer()
    index.apply(BlockStored("a", "device", None, (1,), 0))
    index.apply(BlockStored("a", "device", 1, (2,), 1))
    assert index.apply_snapshot("a", {"device": [1]}, last_event_id=0) is ApplyStatus.STALE
    assert index.worker_blocks("a") == {"device": {1, 2}}


def test_validation() -> None:
    with pytest.raises(ValueError, match="tier_preference"):
        KVIndexer(tier_preference=("device", "host"))
    with pytest.raises(ValueError, match="unknown tiers"):
        KVIndexer().apply_snapshot("a", {"gpu": [1]}, 0)
