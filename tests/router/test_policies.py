"""Router: every policy, membership changes, charging, event filtering, metrics and the stale alarm."""
from __future__ import annotations

import logging
import random

import pytest

from tokenmill.kv.events import BlockStored
from tokenmill.router.cost import CostConfig
from tokenmill.router.decision import RoutingRequest
from tokenmill.router.indexer import ApplyStatus
from tokenmill.router.load import WorkerLoad
from tokenmill.router.policies import NoWorkerAvailable, Router, RouterConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_router(policy: str, workers: tuple[str, ...] = ("a", "b", "c"), **config: object) -> Router:
    router = Router(RouterConfig(policy=policy, block_size=4, **config), rng=random.Random(0))  # type: ignore[arg-type]
    for worker in workers:
        router.add_worker(worker)
    return router


def request(request_id: str, hashes: list[int], extra_tokens: int = 2) -> RoutingRequest:
    return RoutingRequest(request_id, hashes, 4 * len(hashes) + extra_tokens)


def test_kv_routes_to_the_worker_holding_the_prefix_and_explains_why() -> None:
    router = make_router("kv")
    router.apply_event(BlockStored("b", "device", None, (1, 2, 3), 0))
    decision = router.select(request("r1", [1, 2, 3, 4]))
    assert decision.worker == "b" and decision.overlap_blocks == 3 and decision.prompt_blocks == 5
    assert decision.prefill_charge == 2 and decision.decode_charge == 2
    assert {t.worker: t.cost for t in decision.terms} == {"a": 10, "b": 4, "c": 10}
    assert "lowest cost 4" in decision.reason and decision.explain().count("\n") == 3
    assert router.load.load("b") == WorkerLoad(2, 0)   # prefill until the first token ...
    router.on_first_token("r1")
    assert router.load.load("b") == WorkerLoad(0, 2)   # ... then the blocks it holds


def test_kv_balances_load_when_no_worker_holds_the_prompt() -> None:
    router = make_router("kv")
    chosen = [router.select(request(f"r{i}", [100 + i])).worker for i in range(6)]
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]
    for i in range(6):
        router.on_finished(f"r{i}")
    assert all(router.load.load(w).active_blocks == 0 for w in "abc")


def test_kv_approx_learns_from_its_own_decisions() -> None:
    router = make_router("kv-approx")
    first = router.select(request("r1", [1, 2, 3]))
    router.on_finished("r1")
    second = router.select(request("r2", [1, 2, 3, 9]))
    assert second.worker == first.worker and second.overlap_blocks == 3
    assert router.apply_event(BlockStored("a", "device", None, (1,), 0)) is ApplyStatus.IGNORED


def test_round_robin_and_random_ignore_the_cache() -> None:
    router = make_router("round-robin")
    assert [router.select(request(f"r{i}", [1])).worker for i in range(4)] == ["a", "b", "c", "a"]
    assert router.select(request("r9", [1])).reason == "round-robin: next in turn"
    router = make_router("random")
    assert {router.select(request(f"r{i}", [1])).worker for i in range(30)} == {"a", "b", "c"}


def test_least_loaded_takes_the_lighter_of_two_random_workers() -> None:
    router = make_router("least-loaded", workers=("a", "b"))
    router.report_load("a", prefill_blocks=0, decode_blocks=50)
    decisions = [router.select(request(f"r{i}", [i])) for i in range(5)]
    assert all(d.worker == "b" for d in decisions)       # b stays lighter for 5 × 2 blocks
    assert "power of two choices" in decisions[0].reason


def test_workers_join_and_leave_at_any_time() -> None:
    router = make_router("kv", workers=("a",))
    router.apply_event(BlockStored("a", "device", None, (1, 2), 0))
    router.add_worker("b")
    router.remove_worker("a")
    assert router.apply_event(BlockStored("a", "device", 2, (3,), 1)) is ApplyStatus.IGNORED
    decision = router.select(request("r", [1, 2]))
    assert decision.worker == "b" and decision.overlap_blocks == 0
    assert router.select(request("r2", [1]), candidates=["b"]).worker == "b"
    with pytest.raises(ValueError, match="not registered"):
        router.select(request("r3", [1]), candidates=["a"])
    router.remove_worker("b")
    with pytest.raises(NoWorkerAvailable):
        router.select(request("r4", [1]))


def test_late_worker_recovers_through_a_snapshot() -> None:
    router = make_router("kv", workers=("a",))
    assert router.apply_event(BlockStored("a", "device", None, (1,), 12)) is ApplyStatus.GAP
    assert router.apply_snapshot("a", {"device": [1, 2]}, 12) is ApplyStatus.APPLIED
    assert router.select(request("r", [1, 2])).overlap_blocks == 2
    metrics = router.metrics_snapshot()
    assert metrics["tokenmill_router_kv_event_gaps_total"] == 1
    assert metrics["tokenmill_router_kv_event_gaps_recovered_total"] == 1
    assert metrics["tokenmill_router_index_blocks"] == 2
    assert metrics['tokenmill_router_decisions_total{policy="kv"}'] == 1
    assert metrics['tokenmill_router_decision_latency_seconds_bucket{le="+Inf"}'] == 1
    assert metrics['tokenmill_router_overlap_blocks_bucket{le="1"}'] == 0
    assert metrics['tokenmill_router_overlap_blocks_bucket{le="4"}'] == 1


def test_events_stale_flag_rises_with_traffic_but_no_events(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    router = Router(RouterConfig(policy="kv", events_stale_after_s=30.0), rng=random.Random(0), clock=clock)
    router.add_worker("a")
    clock.now = 100.0
    assert router.stats.events_stale() is False              # silence without traffic is fine
    with caplog.at_level(logging.WARNING, logger="tokenmill.router.stats"):
        for i in range(10):
            router.select(RoutingRequest(f"r{i}", [], 5))
        assert router.metrics_snapshot()["tokenmill_router_kv_events_stale"] == 1.0
    assert "own past decisions (kv-approx)" in caplog.text
    router.apply_event(BlockStored("a", "device", None, (1,), 0))
    assert router.stats.events_stale() is False


def test_stale_events_route_on_the_routers_own_decisions_until_they_return() -> None:
    """The event plane is down: the event-built index no longer learns where prompts went, so a
    kv router scores on what it routed itself (the kv-approx index it always keeps), and goes
    back to the events as soon as one arrives."""
    clock = FakeClock()
    router = Router(RouterConfig(policy="kv", events_stale_after_s=30.0), rng=random.Random(0), clock=clock)
    for worker in ("a", "b"):
        router.add_worker(worker)
    clock.now = 100.0
    for i in range(10):  # silent for 100 s across 10 decisions: stale
        router.select(RoutingRequest(f"warm{i}", [1000 + i], 16))
        router.on_finished(f"warm{i}")
    first = router.select(RoutingRequest("first", [1, 2, 3, 4], 64))
    router.on_finished("first")
    again = router.select(RoutingRequest("again", [1, 2, 3, 4], 64))
    assert first.policy == again.policy == "kv-approx"
    assert again.worker == first.worker and again.overlap_blocks == 4  # known only from its own decision
    assert router.metrics_snapshot()['tokenmill_router_decisions_total{policy="kv-approx"}'] == 2
    router.apply_event(BlockStored("b", "device", None, (7,), 0))
    back = router.select(RoutingRequest("back", [1, 2, 3, 4], 64))
    assert back.policy == "kv" and back.overlap_blocks == 0  # the events say nobody holds it


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="--router must be one of"):
        RouterConfig(policy="fastest")
    with pytest.raises(ValueError, match="block hashes for"):
        make_router("kv").select(RoutingRequest("r", [1, 2], 5))
    router = make_router("kv", cost=CostConfig(temperature=1.0))
    assert router.select(request("r", [1])).probability is not None


def test_kv_sends_a_request_where_it_fits_rather_than_where_its_prefix_waits_for_room() -> None:
    shared = list(range(50, 60))                      # a 10-block prefix two running requests share on a
    router = make_router("kv", workers=("a", "b"))
    router.apply_event(BlockStored("a", "device", None, (*shared, 1, 2, 3), 0))
    for worker in ("a", "b"):
        router.report_capacity(worker, 12)
    for rid in ("s1", "s2"):
        assert router.select(request(rid, shared, extra_tokens=0)).worker == "a"
    unlimited = make_router("kv", workers=("a", "b"))  # the same, without pool sizes
    unlimited.apply_event(BlockStored("a", "device", None, (*shared, 1, 2, 3), 0))
    for rid in ("s1", "s2"):
        unlimited.select(request(rid, shared, extra_tokens=0))
    assert unlimited.select(request("r", [1, 2, 3])).worker == "a"  # cheap: its prefix is cached there
    decision = router.select(request("r", [1, 2, 3]))
    assert decision.worker == "b"      # but a's pool is held by the shared prefix: r would wait for room
    short = {t.worker: t.shortfall for t in decision.terms}
    assert short["a"] > 0 and short["b"] == 0 and "short of room" in decision.explain()
