"""TieredKVManager: offload off the step path, the host → disk frequency filter, lookup/load of
the longest run, pinning with write-through, events consistent with tier contents."""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from tests.kv_tiers.helpers import EventLog, RedisServer, make_block
from tokenmill.kv.hashing import block_hashes
from tokenmill.kv.tiered_manager import OffloadBlock, TieredKVManager
from tokenmill.kv.tiers.base import BlockMeta
from tokenmill.kv.tiers.disk import DiskTier
from tokenmill.kv.tiers.host import HostTier
from tokenmill.kv.tiers.payload import snapshot_block, write_block_payload
from tokenmill.kv.tiers.redis_tier import RedisTier
from tokenmill.kv.tiers.shared_dir import SharedDirTier

BLOCK_BYTES = 256


def _offload(block_hash: int, parent: int | None = None) -> OffloadBlock:
    payload, meta = make_block(block_hash, parent, BLOCK_BYTES)
    return OffloadBlock(block_hash, parent, meta.token_ids, payload)


def _manager(tmp_path: Path, log: EventLog, host_blocks: int = 4, **kwargs: object) -> TieredKVManager:
    host = HostTier(host_blocks * BLOCK_BYTES, pin_memory=False)
    disk = DiskTier(tmp_path / "disk", 1 << 20, fsync=False)
    return TieredKVManager(host, disk, events=log.emitter, **kwargs)  # type: ignore[arg-type]


def test_device_kv_roundtrips_through_host_and_disk(tmp_path: Path) -> None:
    kv = torch.randn(2, 2, 6, 4, 2, 8, dtype=torch.bfloat16)
    tokens = list(range(12))
    hashes = block_hashes(tokens, 4)
    manager = _manager(tmp_path, EventLog(), host_blocks=8)  # a block here is 512 bytes
    snapshots = [snapshot_block(kv, b) for b in (1, 3, 5)]
    kv[:, :, [1, 3, 5]] = 0  # the device reuses the blocks right after the snapshot
    blocks = [OffloadBlock(h, hashes[i - 1] if i else None, tuple(tokens[4 * i:4 * i + 4]), snap)
              for i, (h, snap) in enumerate(zip(hashes, snapshots, strict=True))]
    assert manager.offload(blocks) and manager.drain()
    assert manager.lookup(hashes + [999]) == [(h, "host") for h in hashes]
    payloads = manager.load(hashes, [tokens[4 * i:4 * i + 4] for i in range(3)])
    for block_id, payload, snap in zip((0, 2, 4), payloads, snapshots, strict=True):
        write_block_payload(kv, block_id, payload)
        assert torch.equal(kv[:, :, block_id], snap)
    manager.close()


def test_frequency_filter_sends_only_reused_blocks_to_disk(tmp_path: Path) -> None:
    manager = _manager(tmp_path, EventLog(), host_blocks=2)
    manager.offload([_offload(1), _offload(2)])
    manager.drain()
    assert len(manager.load([2])) == 1  # block 2 used twice while in host; block 1 once
    manager.offload([_offload(3), _offload(4)])  # pushes 1 and 2 out of host
    manager.drain()
    assert manager.disk is not None and manager.disk.hashes() == [2]
    assert manager.lookup([2]) == [(2, "disk")] and manager.lookup([1]) == []
    manager.close()


def test_load_stops_at_the_first_block_no_tier_verifies(tmp_path: Path) -> None:
    manager = _manager(tmp_path, EventLog(), host_blocks=8)
    manager.offload([_offload(1), _offload(2, 1), _offload(3, 2)])
    manager.drain()
    tokens = [make_block(h)[1].token_ids for h in (1, 2, 3)]
    assert len(manager.load([1, 2, 3], tokens)) == 3
    assert len(manager.load([1, 2, 3], [tokens[0], (0, 0, 0, 0), tokens[2]])) == 1
    assert manager.stats_counters.token_mismatch == 1
    manager.close()


def test_pinned_prefix_survives_churn_and_is_written_to_shared(tmp_path: Path) -> None:
    log = EventLog()
    host = HostTier(4 * BLOCK_BYTES, pin_memory=False, max_pinned=2)
    shared = SharedDirTier(tmp_path / "shared", 1 << 20, fsync=False)
    manager = TieredKVManager(host, None, shared, events=log.emitter)
    assert manager.pin([100, 101]) and not manager.pin([102, 103, 104])
    manager.offload([_offload(100), _offload(101, 100)])
    for block in range(1, 30):
        manager.offload([_offload(block)])
    manager.drain()
    assert {100, 101} <= set(host.hashes()) and set(shared.hashes()) == {100, 101}
    manager.unpin([100, 101])
    manager.offload([_offload(h) for h in range(200, 206)])
    manager.drain()
    assert not {100, 101} & set(host.hashes())
    manager.close()


def test_offload_never_blocks_and_drops_under_pressure(tmp_path: Path) -> None:
    release = threading.Event()

    class SlowHost(HostTier):
        def put(self, block_hash: int, payload: bytes, meta: BlockMeta) -> bool:
            release.wait(5)
            return super().put(block_hash, payload, meta)

    manager = TieredKVManager(SlowHost(1 << 20, pin_memory=False), max_pending_blocks=3)
    accepted = [manager.offload([_offload(h)]) for h in range(10)]
    assert accepted[:3] == [True] * 3 and not any(accepted[3:])
    assert manager.stats()["offload_dropped"] == 7
    release.set()
    assert manager.drain() and manager.stats()["offload_stored"] == 3
    manager.close()


def test_events_match_tier_contents_after_a_mixed_workload(tmp_path: Path) -> None:
    log = EventLog()
    manager = _manager(tmp_path, log, host_blocks=5)
    for round_ in range(6):
        chain = [_offload(10 * round_ + i, 10 * round_ + i - 1 if i else None) for i in range(4)]
        manager.offload(chain[::-1])  # the device frees chains tail first
        manager.drain()
        manager.load([b.block_hash for b in chain[:2]])
    assert log.ids_are_contiguous()
    held = log.holdings()
    assert {tier: set(hashes) for tier, hashes in manager.cached_hashes().items()} == {
        "host": held.get("host", set()), "disk": held.get("disk", set())}
    stats = manager.stats()
    assert stats["tiers"]["host"]["used_bytes"] <= 5 * BLOCK_BYTES and stats["tiers"]["disk"]["puts"] > 0
    manager.close()


def test_two_workers_share_blocks_through_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    log_a, log_b = EventLog("a"), EventLog("b")
    shared_a = RedisTier(redis_server.url, "model:layout", 1 << 20)
    shared_b = RedisTier(redis_server.url, "model:layout", 1 << 20)
    worker_a = TieredKVManager(HostTier(1 << 20, pin_memory=False), None, shared_a,
                               events=log_a.emitter, write_through=True)
    worker_b = TieredKVManager(HostTier(1 << 20, pin_memory=False), None, shared_b, events=log_b.emitter)
    chain = [_offload(h, h - 1 if h > 1 else None) for h in range(1, 6)]
    worker_a.offload(chain)
    worker_a.drain()
    hashes = [b.block_hash for b in chain]
    assert worker_b.lookup(hashes) == [(h, "shared") for h in hashes]
    assert worker_b.load(hashes, [b.token_ids for b in chain]) == [b.payload for b in chain]
    assert {"host", "shared"} == {e.tier for e in log_a.events}  # type: ignore[union-attr]
    assert worker_b.stats()["tiers"]["shared"]["hits"] == 5
    worker_a.close()
    worker_b.close()


def test_re_evicted_block_is_counted_without_serializing_it_again(tmp_path: Path, monkeypatch) -> None:
    """A block the host already holds (onboarded, then evicted from the device again) counts as
    a use, which lets it pass the disk filter, but is not turned into bytes a second time."""
    from tokenmill.kv import tiered_manager

    serialized: list[int] = []
    real = tiered_manager.block_payload
    monkeypatch.setattr(tiered_manager, "block_payload", lambda t: serialized.append(1) or real(t))
    manager = _manager(tmp_path, EventLog(), host_blocks=2)
    block = OffloadBlock(7, None, (1, 2, 3, 4), torch.zeros(BLOCK_BYTES, dtype=torch.uint8))
    assert manager.offload([block]) and manager.drain()
    assert manager.offload([block]) and manager.drain()
    assert len(serialized) == 1
    assert manager.stats()["offload_stored"] == 2
    manager.offload([_offload(8), _offload(9)])  # pushes 7 out of host: used twice, so to disk
    manager.drain()
    assert manager.disk is not None and manager.disk.hashes() == [7]
    manager.close()
