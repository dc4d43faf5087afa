"""The planner's fast path in the fleet simulator: a step in the load gets capacity asked for
within seconds (so it serves within one replica start-up plus 10 s of the step), not at the next
interval; the fast path only adds; every decision names the path that made it; and a bad period
is refused naming the flag."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from tests.planner.test_constrain import Steady
from tokenmill.planner.constrain import Constrainer, Limits
from tokenmill.planner.decision import Decision
from tokenmill.planner.flags import add_planner_arguments, check_planner_flags
from tokenmill.planner.setup import make_planner
from tokenmill.planner.simulated import SimulatedDeployment
from tokenmill.sim.fleet.arrivals import TraceRequest
from tokenmill.sim.fleet.clock import parse_profile
from tokenmill.sim.fleet.config import SLA, FleetConfig
from tokenmill.sim.fleet.fleet import FleetSim
from tokenmill.sim.fleet.synthetic import synthetic

PROFILE = "llama-3.1-70b@h100:fp8:tp4"
INTERVAL_S, FAST_S, STARTUP_S = 60.0, 5.0, 30.0
STEP_S = 125.0  # just after an interval's decision: the next one is 55 s away


def _step_load() -> list[TraceRequest]:
    """1 req/s of 8k-token prompts until STEP_S, then 4 req/s for three minutes."""
    out: list[TraceRequest] = []
    for start, rate, duration in ((0.0, 1.0, STEP_S), (STEP_S, 4.0, 180.0)):
        for r in synthetic("poisson", rate=rate, duration_s=duration, input_tokens=8000, output_tokens=100,
                           seed=int(start)):
            out.append(dataclasses.replace(r, request_id=f"r{len(out)}", arrival_s=start + r.arrival_s,
                                           block_hashes=tuple(h + len(out) * 10_007 for h in r.block_hashes)))
    return out


def _run(fast_s: float | None) -> tuple[list[Decision], FleetSim, int]:
    profile = parse_profile(PROFILE)
    config = FleetConfig(profiles={"agg": profile}, agg=2, sla=SLA(1.0, 0.05), replica_startup_s=STARTUP_S,
                         interval_s=INTERVAL_S)
    planner = make_planner(config.profiles, False, "sla", Steady(), Limits(max_step=4), 1.0, 0.05,
                           config.max_num_seqs, config.max_num_batched_tokens)
    deployment = SimulatedDeployment(planner, INTERVAL_S, warmup_s=60.0, fast_s=fast_s)
    sim = FleetSim(config)
    requests = _step_load()
    sim.run(requests, controller=deployment.tick, tick_s=deployment.tick_s)
    return deployment.decisions, sim, len(requests)


def _first_addition_after_step(decisions: list[Decision]) -> Decision:
    return next(d for d in decisions if d.at_s > STEP_S and any(a.delta > 0 for a in d.actions))


def test_a_step_gets_capacity_within_one_start_up_and_10_s() -> None:
    decisions, sim, requests = _run(FAST_S)
    first = _first_addition_after_step(decisions)
    assert first.path == "fast" and first.reason.startswith("fast path: agg: ")
    assert first.at_s - STEP_S <= 10.0, first.reason  # so it serves by STEP_S + STARTUP_S + 10 s
    added = next(c for c in sim.change_log if c.action == "add" and c.at_s > STEP_S)
    assert added.at_s == first.at_s
    fast = [d for d in decisions if d.path == "fast"]
    assert all(a.delta > 0 for d in fast for a in d.actions)  # the fast path never removes
    assert {d.path for d in decisions} <= {"forecast", "scale-down", "fast", "held"}
    assert all(d.path == "scale-down" for d in decisions if d.actions and all(a.delta < 0 for a in d.actions))
    assert all(r.finished for r in sim.records.values()) and len(sim.records) == requests
    # without it the same step waits for the next interval's decision
    slow, _, _ = _run(None)
    assert _first_addition_after_step(slow).at_s >= STEP_S + INTERVAL_S - 5.0 - 1e-9
    assert not any(d.path == "fast" for d in slow)


def test_bad_planner_flags_are_refused_naming_them() -> None:
    parser = argparse.ArgumentParser()
    add_planner_arguments(parser)
    check_planner_flags(parser.parse_args([]))  # off by default
    check_planner_flags(parser.parse_args(["--fast-path-s", "5"]))
    for bad in ("0", "-1", "30", "45"):
        with pytest.raises(ValueError, match="--fast-path-s"):
            check_planner_flags(parser.parse_args(["--fast-path-s", bad]))
    for flag in ("--burst-quantile", "--forecast-quantile"):
        with pytest.raises(ValueError, match=flag):
            check_planner_flags(parser.parse_args([flag, "1.5"]))


def test_the_fast_path_leaves_the_sustained_low_count_alone() -> None:
    """A fast addition to one pool must not reset another pool's run of intervals wanting fewer."""
    constrainer = Constrainer(Limits(max_step=2, scale_down_intervals=3), {"prefill": 4, "decode": 4})
    constrainer.apply({"prefill": 2, "decode": 2}, {"prefill": 2, "decode": 4}, {"prefill": 2.0, "decode": 1.0})
    grown = constrainer.grow({"prefill": 6, "decode": 4}, {"prefill": 2, "decode": 4})
    assert grown.replicas == {"prefill": 4, "decode": 4} and any("at most 2" in n for n in grown.notes)
    assert constrainer.below_for["decode"] == 1
