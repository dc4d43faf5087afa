"""Every tier keeps its byte budget under random load, returns exactly what it stored, evicts
children before parents, and its tier-tagged events replay to exactly what it holds."""
from __future__ import annotations

import random
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kv_tiers.helpers import EventLog, RedisServer, make_block
from tokenmill.kv.events import BlockRemoved, BlockStored
from tokenmill.kv.tiers.base import Tier
from tokenmill.kv.tiers.disk import DiskTier
from tokenmill.kv.tiers.host import HostTier
from tokenmill.kv.tiers.redis_tier import RedisTier
from tokenmill.kv.tiers.shared_dir import SharedDirTier

# (block id 1..60, payload size); block i's parent is i // 2, so the blocks form a tree.
load_strategy = st.lists(st.tuples(st.integers(1, 60), st.integers(8, 300)), min_size=1, max_size=80)


def _parent(block: int) -> int | None:
    return None if block == 1 else block // 2


def _apply_load(tier: Tier, log: EventLog, load: list[tuple[int, int]], capacity: int) -> None:
    stored: dict[int, bytes] = {}
    for block, size in load:
        payload, meta = make_block(block, _parent(block), size)
        payload = stored.setdefault(block, payload)  # a hash always names the same content
        tier.put(block, payload, meta)
        assert tier.used_bytes <= capacity
        if block in tier.hashes():
            found = tier.get(block)
            assert found is not None and found[0] == payload and found[1].parent == meta.parent
    assert log.ids_are_contiguous()
    assert log.holdings().get(tier.name, set()) == set(tier.hashes())
    _assert_parents_outlive_children(log)


def _assert_parents_outlive_children(log: EventLog) -> None:
    held: set[int] = set()
    for event in log.events:
        if isinstance(event, BlockStored):
            held.update(event.hashes)
        elif isinstance(event, BlockRemoved):
            for gone in event.hashes:
                held.discard(gone)
                assert not any(_parent(h) == gone for h in held), f"block {gone} evicted before a child"


@settings(max_examples=80, deadline=None)
@given(load=load_strategy, capacity=st.integers(300, 3000), kind=st.sampled_from(["host", "disk", "shared"]))
def test_local_tiers_hold_capacity_under_random_load(load: list, capacity: int, kind: str) -> None:
    log = EventLog()
    with tempfile.TemporaryDirectory() as root:
        if kind == "host":
            tier: Tier = HostTier(capacity, events=log.emitter)
        elif kind == "disk":
            tier = DiskTier(root, capacity, fsync=False, events=log.emitter)
        else:
            tier = SharedDirTier(root, capacity, fsync=False, events=log.emitter)
        _apply_load(tier, log, load, capacity)
        if kind != "host":  # what is on disk is exactly what the index says
            assert len(list(Path(root).glob("??/*.blk"))) == len(tier.hashes())


def test_redis_tier_holds_capacity_under_random_load(redis_server: RedisServer) -> None:
    rng = random.Random(7)
    for trial in range(5):
        capacity = rng.randint(800, 4000)
        log = EventLog()
        tier = RedisTier(redis_server.url, f"cap{trial}", capacity, events=log.emitter)
        load = [(rng.randint(1, 60), rng.randint(8, 300)) for _ in range(150)]
        _apply_load(tier, log, load, capacity)
        tier.close()
