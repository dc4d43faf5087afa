"""`tokenmill planner choose`: the deployment shape and planner mode are chosen by the planner's
own simulated runs on the load. A load of long prompts and short outputs is served
disaggregated (an aggregated pool's prefill chunks stall its streams past the ITL target), a load
of short prompts and long outputs aggregated (a prefill pool would sit idle); the rule picks the
cheapest run reaching the target, else the closest; bad flags exit 2 naming the flag."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenmill.planner.choose import (
    Burstiness,
    Candidate,
    CandidateRun,
    add_arguments,
    candidates_from,
    choose,
    report,
)
from tokenmill.planner.choose import run as choose_cmd

LOAD = ["--synthetic", "poisson", "--rate", "4", "--duration-s", "300", "--model", "llama-3.1-8b", "--gpu", "h100",
        "--layout", "tp1", "--ttft-ms", "1000", "--itl-ms", "30", "--attainment", "0.99"]


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*LOAD, *flags])


def _run(shape: str, mode: str, attainment: float, gpu_hours: float, itl_miss: float = 0.0) -> CandidateRun:
    return CandidateRun(Candidate(shape, mode, None if shape == "agg" else 256), attainment, gpu_hours,
                        0.0, itl_miss, 1)


def test_the_cheapest_run_reaching_the_target_is_chosen_else_the_closest() -> None:
    runs = [_run("agg", "sla", 0.97, 10.0), _run("disagg", "sla", 0.99, 12.0), _run("disagg", "hybrid", 0.995, 12.0),
            _run("agg", "load", 0.90, 5.0)]
    choice = choose(runs, 0.95)
    assert choice.run is runs[0] and choice.reached and "fewest GPU-hours (10.0)" in choice.reason
    choice = choose(runs, 0.99)  # a tie on GPU-hours goes to the higher attainment
    assert choice.run is runs[2] and choice.reached
    choice = choose(runs, 0.999)
    assert choice.run is runs[2] and not choice.reached and choice.reason.startswith("no candidate reaches 99.9%")
    with pytest.raises(ValueError):
        choose([], 0.9)


def test_a_load_of_long_prompts_and_short_outputs_is_served_disaggregated(tmp_path: Path) -> None:
    args = _args("--isl", "6000", "--osl", "12", "--modes", "sla", "--thresholds", "256",
                 "--json", str(tmp_path / "choice.json"))
    assert choose_cmd(args) == 0
    out = json.loads((tmp_path / "choice.json").read_text())
    runs = {r["candidate"]["shape"]: r for r in out["runs"]}
    assert out["choice"]["candidate"]["shape"] == "disagg" and out["choice"]["reached"]
    agg = runs["agg"]
    # the aggregated pool misses on ITL, not on TTFT: its prefill chunks stall the streams
    assert agg["attainment"] < 0.99 and agg["itl_miss_share"] > agg["ttft_miss_share"]
    assert "miss ITL (prefill chunks stall" in agg["vs_choice"]
    assert runs["disagg"]["vs_choice"] is None and runs["disagg"]["attainment"] >= 0.99


def test_a_load_of_short_prompts_and_long_outputs_is_served_aggregated() -> None:
    out = report(_args("--isl", "200", "--osl", "400", "--modes", "sla", "--thresholds", "256"))
    runs = {r["candidate"]["shape"]: r for r in out["runs"]}
    assert out["choice"]["candidate"]["shape"] == "agg"
    assert runs["agg"]["attainment"] >= 0.99 and runs["agg"]["gpu_hours"] < runs["disagg"]["gpu_hours"]
    assert "x the GPU-hours" in runs["disagg"]["vs_choice"]


def test_every_shape_threshold_and_mode_asked_for_is_a_candidate() -> None:
    candidates = candidates_from(_args("--shapes", "agg,disagg", "--thresholds", "0,2048", "--modes", "sla,hybrid"))
    assert candidates == [Candidate("agg", "sla"), Candidate("agg", "hybrid"), Candidate("disagg", "sla", 0),
                          Candidate("disagg", "hybrid", 0), Candidate("disagg", "sla", 2048),
                          Candidate("disagg", "hybrid", 2048)]


def test_burstiness_of_an_on_off_load() -> None:
    # 30 s intervals: 10 arrivals, none, 50 arrivals (mean 20); the one at 90 s opens a partial interval
    arrivals = [i * 3.0 for i in range(10)] + [60.0 + i * 0.5 for i in range(50)] + [90.0]
    b = Burstiness.of(arrivals, 30.0)
    assert b.peak_to_mean == pytest.approx(2.5) and b.idle_share == pytest.approx(1 / 3)
    assert b.cv == pytest.approx(((100 + 400 + 900) / 3) ** 0.5 / 20)
    assert "33% are empty" in b.describe()
    assert Burstiness.of([0.0, 45.0], 30.0).idle_share == 0.0


@pytest.mark.parametrize("flags, named", [
    (["--shapes", "agg,pd"], "--shapes"), (["--modes", "fast"], "--modes"), (["--thresholds", "a"], "--thresholds"),
    (["--shapes", "disagg", "--thresholds", ""], "--thresholds"), (["--attainment", "0"], "--attainment"),
    (["--attainment", "1.5"], "--attainment"), (["--jobs", "0"], "--jobs"), (["--layout", "tp3x"], "--layout"),
    (["--plot", "out.png"], "--plot"), (["--agg", "2"], "--agg"), (["--json", "/dev/null/x.json"], "--json"),
])
def test_bad_flags_exit_2_naming_the_flag(flags: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert choose_cmd(_args(*flags)) == 2
    line = capsys.readouterr().out.strip()
    assert line.startswith("error: ") and named in line and "\n" not in line
