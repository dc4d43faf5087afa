"""The Redis tier against a real redis-server: damaged values and a server that goes away are
counted misses, never exceptions or wrong bytes; it comes back when the server does."""
from __future__ import annotations

import time

import redis

from tests.kv_tiers.helpers import EventLog, RedisServer, make_block
from tokenmill.kv.tiers.redis_tier import RedisTier, namespace_for


def test_roundtrip_and_namespaces_do_not_meet(redis_server: RedisServer) -> None:
    model_a = RedisTier(redis_server.url, namespace_for("model-a", "bf16-bs16"), 1 << 20)
    model_b = RedisTier(redis_server.url, namespace_for("model-b", "bf16-bs16"), 1 << 20)
    payload, meta = make_block(3, 2, 2048)
    assert model_a.put(3, payload, meta)
    assert model_a.get(3) == (payload, meta) and model_a.contains_many([3, 4]) == [True, False]
    assert model_b.get(3) is None and model_b.stats.misses == 1


def test_corrupt_value_is_a_counted_miss_and_deleted(redis_server: RedisServer) -> None:
    log = EventLog()
    tier = RedisTier(redis_server.url, "corrupt", 1 << 20, events=log.emitter)
    payload, meta = make_block(11, None, 4096)
    tier.put(11, payload, meta)
    raw = redis.Redis(port=redis_server.port)
    key = f"corrupt:b:{11:016x}"
    raw.setrange(key, len(raw.get(key)) - 1, b"\x00" if payload[-1] else b"\x01")  # type: ignore[arg-type]
    assert tier.get(11) is None
    assert tier.stats.corrupt == 1 and tier.stats.misses == 1 and tier.stats.hits == 0
    assert not tier.contains(11) and tier.used_bytes == 0
    assert log.holdings()["shared"] == set()


def test_server_down_means_misses_then_recovery(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, "outage", 1 << 20, timeout_s=0.2, retry_after_s=0.1, max_backoff_s=0.2)
    payload, meta = make_block(1, None, 1000)
    assert tier.put(1, payload, meta)
    redis_server.stop()
    for block in range(2, 40):  # no exception reaches the caller, however often it asks
        assert tier.get(1) is None
        assert not tier.put(block, *make_block(block))
        assert tier.contains_many([1, block]) == [False, False]
        assert not tier.pin([block]) and tier.hashes() == [] and tier.used_bytes == 0
    assert tier.stats.errors >= 1 and tier.stats.misses >= 38 and tier.stats.hits == 0
    redis_server.start()  # a fresh, empty server on the same port
    deadline = time.monotonic() + 5
    while not tier.put(1, payload, meta):
        assert time.monotonic() < deadline, "the tier never reconnected"
        time.sleep(0.05)
    assert tier.get(1) == (payload, meta)


def test_second_worker_loads_the_first_workers_blocks(redis_server: RedisServer) -> None:
    worker_a = RedisTier(redis_server.url, "shared-ns", 1 << 20)
    worker_b = RedisTier(redis_server.url, "shared-ns", 1 << 20)
    chain = [(h, *make_block(h, h - 1 if h > 1 else None, 512)) for h in range(1, 6)]
    for block_hash, payload, meta in chain:
        worker_a.put(block_hash, payload, meta)
    assert worker_b.contains_many([h for h, _, _ in chain]) == [True] * 5
    assert [worker_b.get(h) for h, _, _ in chain] == [(p, m) for _, p, m in chain]
    assert worker_b.used_bytes == worker_a.used_bytes > 0  # one budget, kept inside Redis


def test_pins_are_shared_and_capped(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, "pins", 3000, max_pinned=2)
    assert tier.pin([1, 2]) and not tier.pin([3])
    for block in (1, 2, 3, 4, 5, 6):
        tier.put(block, *make_block(block, None, 900))
    assert {1, 2} <= set(tier.hashes()) and tier.used_bytes <= 3000
    tier.unpin([1])
    tier.put(7, *make_block(7, None, 900))
    assert 1 not in tier.hashes()
