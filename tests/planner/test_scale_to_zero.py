"""Scale to zero in the planner and the fleet simulator: a pool with minimum 0 goes to 0 only after
its idle wait, a request that arrives to it then wakes the cold-start path at once and is served
after one replica's start-up, and every step says why."""
from __future__ import annotations

import dataclasses

import pytest

from tests.planner.test_constrain import FixedModel, Steady
from tokenmill.planner.constrain import Constrainer, Limits
from tokenmill.planner.observation import SERVING, STARTING, Observation
from tokenmill.planner.planner import COLD_RETRY_S, Planner
from tokenmill.planner.propose import Proposer
from tokenmill.planner.setup import make_planner
from tokenmill.planner.simulated import SimulatedDeployment
from tokenmill.sim.fleet.arrivals import TraceRequest
from tokenmill.sim.fleet.clock import parse_profile
from tokenmill.sim.fleet.config import SLA, FleetConfig
from tokenmill.sim.fleet.fleet import FleetSim
from tokenmill.sim.fleet.report import summarize
from tokenmill.sim.fleet.synthetic import synthetic

INTERVAL = 30.0
STARTUP_S = 60.0
QUIET_FROM_S, BACK_AT_S = 300.0, 1800.0  # the load stops, then comes back


def test_a_pool_with_minimum_zero_goes_to_zero_only_after_its_idle_wait() -> None:
    constrainer = Constrainer(Limits(min_replicas={"agg": 0}, zero_after_intervals=3, scale_down_intervals=1,
                                       max_step=10), {"agg": 1})
    held = constrainer.apply({"agg": 0}, {"agg": 1}, {"agg": 0.0}, idle_for={"agg": 2})
    assert held.replicas == {"agg": 1} and "until idle for 3 intervals (2 so far)" in held.notes[0]
    gone = constrainer.apply({"agg": 0}, {"agg": 1}, {"agg": 0.0}, idle_for={"agg": 3})
    assert gone.replicas == {"agg": 0} and "no request for 3 intervals: scaled to zero" in gone.notes[0]
    # before the wait is over, a larger pool comes down as usual, to one replica at the least
    assert constrainer.apply({"agg": 0}, {"agg": 4}, {"agg": 0.0}, idle_for={"agg": 1}).replicas == {"agg": 1}
    # a minimum of 1 never goes to zero, however long idle
    keeps = Constrainer(Limits(zero_after_intervals=1), {"agg": 1})
    assert keeps.apply({"agg": 0}, {"agg": 1}, {"agg": 0.0}, idle_for={"agg": 50}).replicas == {"agg": 1}
    # a pool not under the idle rule (a prefill pool: the decode pool prefills itself) goes by the usual ones
    prefill = Constrainer(Limits(min_replicas={"prefill": 0, "decode": 0}, scale_down_intervals=1), {"prefill": 1})
    assert prefill.apply({"prefill": 0, "decode": 1}, {"prefill": 1, "decode": 1}, {"prefill": 0.0, "decode": 0.5},
                         idle_for={"decode": 0}).replicas == {"prefill": 0, "decode": 1}


def _planner(**limits) -> Planner:
    proposer = Proposer({"agg": FixedModel()}, disaggregated=False)  # type: ignore[dict-item]
    return Planner(Steady(), proposer, Constrainer(Limits(**limits), {"agg": 4}))


def _idle(at: float, serving: int) -> Observation:
    return Observation(at_s=at, interval_s=INTERVAL, requests=0, queue_depth=0, replicas={"agg": {SERVING: serving}})


def test_the_planner_counts_idle_intervals_and_any_arrival_restarts_the_count() -> None:
    planner = _planner(min_replicas={"agg": 0}, zero_after_intervals=3)
    assert not planner.step(_idle(30, 1)).actions
    assert not planner.step(_idle(60, 1)).actions
    busy = Observation(at_s=90, interval_s=INTERVAL, requests=1, mean_isl=100.0, mean_osl=10.0,
                       replicas={"agg": {SERVING: 1}})
    assert not planner.step(busy).actions
    assert [planner.step(_idle(at, 1)).actions for at in (120, 150)] == [[], []]
    last = planner.step(_idle(180, 1))
    assert [(a.role, a.delta) for a in last.actions] == [("agg", -1)] and last.path == "scale-down"
    assert "idle for 3 interval(s), minimum 0: 0 wanted" in last.reason and "scaled to zero" in last.reason
    assert planner.may_scale_to_zero and not _planner().may_scale_to_zero


def test_the_cold_start_path_adds_a_replica_only_to_an_empty_pool_with_requests_waiting() -> None:
    planner = _planner(min_replicas={"agg": 0}, max_replicas={"agg": 3})
    empty = Observation(at_s=5, interval_s=2.0, waiting_for_worker=2, replicas={})
    decision = planner.cold_step(empty)
    assert decision is not None and decision.path == "cold-start"
    assert [(a.role, a.delta) for a in decision.actions] == [("agg", 1)]
    assert decision.reason == "cold start: agg: 2 request(s) waiting and no agg replica (scaled to zero); +1 agg"
    assert planner.decisions[-1] is decision
    starting = Observation(at_s=6, interval_s=2.0, waiting_for_worker=2, replicas={"agg": {STARTING: 1}})
    assert planner.cold_step(starting) is None  # one is on its way: nothing more
    assert planner.cold_step(Observation(at_s=7, interval_s=2.0, waiting_for_worker=0, replicas={})) is None
    capped = _planner(min_replicas={"agg": 0}, max_replicas={"agg": 0})
    assert capped.cold_step(empty) is None  # its maximum is 0: nothing may start
    # the replica it started failed at once (it is counted nowhere): no new start every poll...
    assert planner.cold_step(Observation(at_s=10, interval_s=2.0, waiting_for_worker=2, replicas={})) is None
    # ... but one after COLD_RETRY_S
    retried = planner.cold_step(Observation(at_s=5 + COLD_RETRY_S, interval_s=2.0, waiting_for_worker=2, replicas={}))
    assert retried is not None and retried.path == "cold-start"


def _on_off() -> list[TraceRequest]:
    """1 req/s of 2k-token prompts for 5 minutes, 25 minutes of nothing, then 5 minutes more."""
    out: list[TraceRequest] = []
    for start in (0.0, BACK_AT_S):
        for r in synthetic("poisson", rate=1.0, duration_s=QUIET_FROM_S, input_tokens=2000, output_tokens=100,
                           seed=int(start)):
            out.append(dataclasses.replace(r, request_id=f"r{len(out)}", arrival_s=start + r.arrival_s,
                                           block_hashes=tuple(h + len(out) * 10_007 for h in r.block_hashes)))
    return out


def _simulate(minimum: int, fast_s: float | None = None) -> tuple[FleetSim, SimulatedDeployment]:
    config = FleetConfig(profiles={"agg": parse_profile("llama-3.1-70b@h100:fp8:tp4")}, agg=1, sla=SLA(1.0, 0.05),
                         replica_startup_s=STARTUP_S, interval_s=INTERVAL)
    limits = Limits(min_replicas={"agg": minimum}, max_step=4, scale_down_intervals=4, zero_after_intervals=10)
    planner = make_planner(config.profiles, False, "sla", Steady(), limits, 1.0, 0.05, config.max_num_seqs,
                           config.max_num_batched_tokens)
    deployment = SimulatedDeployment(planner, INTERVAL, warmup_s=60.0, fast_s=fast_s)
    sim = FleetSim(config)
    sim.run(_on_off(), controller=deployment.tick, tick_s=deployment.tick_s, wake=deployment.wake)
    return sim, deployment


def test_the_simulator_scales_an_idle_pool_to_zero_and_prices_the_cold_start() -> None:
    sim, deployment = _simulate(minimum=0)
    assert all(r.finished for r in sim.records.values()) and len(sim.records) == len(_on_off())
    last_before = max(r.arrival_s for r in sim.records.values() if r.arrival_s < BACK_AT_S)
    [to_zero] = [d for d in deployment.decisions if d.target.get("agg") == 0 and d.actions]
    assert to_zero.path == "scale-down" and "scaled to zero" in to_zero.reason
    assert to_zero.at_s >= last_before + 10 * INTERVAL - INTERVAL  # ten idle intervals, the first partial
    [cold] = [d for d in deployment.decisions if d.path == "cold-start"]
    first_back = min((r for r in sim.records.values() if r.arrival_s >= BACK_AT_S), key=lambda r: r.arrival_s)
    assert cold.at_s == pytest.approx(first_back.arrival_s)  # woken by the arrival, not the next interval
    assert first_back.ttft_s >= STARTUP_S  # it waited for the replica's start-up, and was then served
    always_on, _ = _simulate(minimum=1)
    assert summarize(sim).totals["gpu_hours"] < summarize(always_on).totals["gpu_hours"]


def test_first_tokens_held_through_a_cold_start_do_not_grow_the_pool() -> None:
    """Their TTFT is the start-up's: the fast path must not read it as a pool too small."""
    sim, deployment = _simulate(minimum=0, fast_s=5.0)
    [cold] = [d for d in deployment.decisions if d.path == "cold-start"]
    after = [d for d in deployment.decisions if cold.at_s < d.at_s < cold.at_s + STARTUP_S + 3 * INTERVAL]
    assert not [d for d in after if d.path == "fast"], [d.reason for d in after if d.path == "fast"]
    assert any("TTFT not used: requests waited through a cold start" in r for d in after for r in d.proposal_reasons)
    assert all(r.finished for r in sim.records.values())
