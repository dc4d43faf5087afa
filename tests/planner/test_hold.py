"""The level hold: a pool is sized for the quantile of its recent proposals, so a burst shorter
than a start-up is not chased and a lull before the next burst does not empty the pool; a level
that lasts moves it; bad flags are refused naming them."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from tokenmill.planner.flags import check_planner_flags
from tokenmill.planner.hold import LevelHold
from tokenmill.planner.setup import hold_from
from tokenmill.planner.simulate import add_arguments, run_planned
from tokenmill.sim.fleet.arrivals import TraceRequest
from tokenmill.sim.fleet.clock import parse_profile
from tokenmill.sim.fleet.config import SLA, FleetConfig
from tokenmill.sim.fleet.synthetic import synthetic

ON_S, OFF_S, CYCLES = 40.0, 140.0, 8  # a burst shorter than the 60 s start-up, then a lull


def test_a_short_swing_moves_nothing_and_a_lasting_level_moves_the_pool() -> None:
    hold = LevelHold(quantile=0.8, window=10)  # k = 8 of 10
    for _ in range(10):
        assert hold.apply({"agg": 4}) == ({"agg": 4}, [])
    held, reasons = hold.apply({"agg": 9})  # one interval's burst
    assert held == {"agg": 4} and "the 80% quantile of the last 10 intervals' proposals (4-9)" in reasons[0]
    assert hold.apply({"agg": 9})[0] == {"agg": 4}
    assert hold.apply({"agg": 9})[0] == {"agg": 9}  # n - k + 1 = 3 intervals at the new level move the pool
    for _ in range(7):  # a fall takes k = 8 intervals
        assert hold.apply({"agg": 2})[0] == {"agg": 9}
    assert hold.apply({"agg": 2})[0] == {"agg": 2}
    both = LevelHold(0.5, 2)  # each pool keeps its own window
    both.apply({"prefill": 1, "decode": 7})
    assert both.apply({"prefill": 3, "decode": 5})[0] == {"prefill": 1, "decode": 5}


def _parser_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "llama-3.1-70b", "--gpu", "h100", "--agg", "1", "--layout", "tp4",
                              "--ttft-ms", "1000", "--itl-ms", "50", "--planner-interval-s", "30", *flags])


def test_the_window_defaults_to_ten_start_ups_in_the_simulator_and_off_live() -> None:
    assert hold_from(_parser_args(), replica_startup_s=60.0) == (0.8, 20)
    assert hold_from(_parser_args()) is None  # live: the start-up is not known
    assert hold_from(_parser_args("--hold-window-s", "300", "--hold-quantile", "0.6")) == (0.6, 10)
    assert hold_from(_parser_args("--hold-window-s", "0"), replica_startup_s=60.0) is None
    for flags, named in ((["--hold-quantile", "1.5"], "--hold-quantile"), (["--hold-window-s", "-1"], "--hold-window-s")):
        with pytest.raises(ValueError, match=named):
            check_planner_flags(_parser_args(*flags))


def _on_off_load() -> list[TraceRequest]:
    """CYCLES bursts of ON_S seconds (6 req/s of 6k-token prompts), each followed by OFF_S of silence."""
    out: list[TraceRequest] = []
    for cycle in range(CYCLES):
        start = cycle * (ON_S + OFF_S)
        for r in synthetic("poisson", rate=6.0, duration_s=ON_S, input_tokens=6000, output_tokens=20, seed=cycle):
            out.append(dataclasses.replace(r, request_id=f"r{len(out)}", arrival_s=start + r.arrival_s,
                                           block_hashes=tuple(h + len(out) * 10_007 for h in r.block_hashes)))
    return out


def _targets(*flags: str) -> list[tuple[float, int]]:
    args = _parser_args("--predictor", "constant", "--scale-down-intervals", "2", *flags)
    config = FleetConfig(profiles={"agg": parse_profile("llama-3.1-70b@h100:fp8:tp4")}, agg=2, sla=SLA(1.0, 0.05),
                         replica_startup_s=60.0, interval_s=30.0)
    run = run_planned(config, _on_off_load(), args)
    assert all(r.finished for r in run.result.records)
    return [(d.at_s, d.target["agg"]) for d in run.decisions]


def test_an_on_off_load_keeps_its_pool_through_the_lulls() -> None:
    """Unheld, the pool drops in each lull and is short when the next burst comes; held, once
    the first bursts are seen it stays at the bursts' level through the lulls."""
    settled = 3 * (ON_S + OFF_S)

    def dips(targets: list[tuple[float, int]]) -> int:
        after = [n for t, n in targets if t >= settled]
        return sum(1 for a, b in zip(after, after[1:]) if b < a)

    unheld, held = _targets("--hold-window-s", "0"), _targets()
    assert dips(unheld) >= 2  # the check can fail: without the hold the pool does shrink in the lulls
    assert dips(held) == 0, held
    assert min(n for t, n in held if t >= settled) >= max(n for t, n in unheld if t >= settled) - 1


def test_a_window_shorter_than_an_interval_is_refused_not_dropped() -> None:
    with pytest.raises(ValueError, match=r"--hold-window-s must be 0 \(off\) or span at least one"):
        check_planner_flags(_parser_args("--hold-window-s", "10"))
