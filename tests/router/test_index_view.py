"""The admin view of a router's KV index: per worker and tier, counts and an order-free digest
that two routers fed the same events agree on, and that differ as soon as one block does."""
from __future__ import annotations

from tokenmill.kv.events import BlockRemoved, BlockStored
from tokenmill.router.index_view import hashes_digest, index_view
from tokenmill.router.indexer import KVIndexer

BIG = 2**64 - 1  # block hashes are unsigned 64-bit


def _fed(order: list) -> KVIndexer:
    index = KVIndexer()
    for event in order:
        index.apply(event)
    return index


def test_same_blocks_give_the_same_view_whatever_the_order_of_workers() -> None:
    a = [BlockStored("a", "device", None, (1, 2, BIG), 0), BlockStored("a", "host", None, (9,), 1)]
    b = [BlockStored("b", "device", None, (1, 5), 0), BlockRemoved("b", "device", (5,), 1)]
    first, second = _fed(a + b), _fed(b + a)
    assert index_view(first, with_hashes=True) == index_view(second, with_hashes=True)
    view = index_view(first, with_hashes=True)
    assert view["blocks"] == 5
    assert view["workers"]["a"]["tiers"]["device"]["hashes"] == [1, 2, BIG]
    assert view["workers"]["b"] == {"last_event_id": 1, "awaiting_snapshot": False,
                                    "tiers": {"device": {"blocks": 1, "digest": hashes_digest([1]),
                                                         "hashes": [1]}}}
    assert "hashes" not in index_view(first)["workers"]["a"]["tiers"]["device"]


def test_one_different_block_changes_the_digest() -> None:
    assert hashes_digest([3, 1, 2]) == hashes_digest([1, 2, 3])
    assert hashes_digest([1, 2, 3]) != hashes_digest([1, 2, 4])
    assert hashes_digest([]) != hashes_digest([0])


def test_a_gap_shows_as_awaiting_snapshot() -> None:
    index = _fed([BlockStored("a", "device", None, (1,), 0), BlockStored("a", "device", 1, (2,), 5)])
    assert index_view(index)["workers"]["a"]["awaiting_snapshot"] is True

