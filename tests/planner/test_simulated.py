"""The planner driving the fleet simulator: a load that doubles adds replicas within two
intervals, a load that falls removes them after the sustained period, nothing is dropped, and
every change is explained. Then `tokenmill planner simulate` end to end, with its baselines."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from tests.planner.test_constrain import Steady
from tokenmill.cli import main
from tokenmill.planner.constrain import Limits
from tokenmill.planner.setup import make_planner
from tokenmill.planner.simulate import static_peak
from tokenmill.planner.simulated import SimulatedDeployment
from tokenmill.sim.fleet.arrivals import TraceRequest
from tokenmill.sim.fleet.clock import parse_profile
from tokenmill.sim.fleet.config import SLA, FleetConfig
from tokenmill.sim.fleet.fleet import FleetSim
from tokenmill.sim.fleet.report import summarize
from tokenmill.sim.fleet.synthetic import synthetic

PROFILE = "llama-3.1-70b@h100:fp8:tp4"
INTERVAL = 30.0


RISE_S, FALL_S = 300.0, 600.0  # the load doubles, then falls


def _phases() -> list[TraceRequest]:
    """2 req/s for 5 min, 4 req/s for 5 min, then 0.5 req/s for 10 min; 8k-token prompts."""
    out: list[TraceRequest] = []
    for start, rate, duration in ((0.0, 2.0, RISE_S), (RISE_S, 4.0, FALL_S - RISE_S), (FALL_S, 0.5, 600.0)):
        for r in synthetic("poisson", rate=rate, duration_s=duration, input_tokens=8000, output_tokens=100,
                           seed=int(start)):
            out.append(dataclasses.replace(r, request_id=f"r{len(out)}", arrival_s=start + r.arrival_s,
                                           block_hashes=tuple(h + len(out) * 10_007 for h in r.block_hashes)))
    return out


def test_the_planner_follows_a_doubling_and_a_fall_without_losing_a_request() -> None:
    profile = parse_profile(PROFILE)
    config = FleetConfig(profiles={"agg": profile}, agg=2, sla=SLA(1.0, 0.05), replica_startup_s=60.0,
                         interval_s=INTERVAL)
    limits = Limits(min_replicas={"agg": 1}, max_step=4, scale_down_intervals=4)
    planner = make_planner(config.profiles, False, "sla", Steady(), limits, 1.0, 0.05, config.max_num_seqs,
                           config.max_num_batched_tokens)
    deployment = SimulatedDeployment(planner, INTERVAL, warmup_s=60.0)
    sim = FleetSim(config)
    requests = _phases()
    sim.run(requests, controller=deployment.tick, tick_s=INTERVAL)
    decisions = deployment.decisions
    before = max(d.target["agg"] for d in decisions if RISE_S / 2 <= d.at_s < RISE_S)
    grown = [d for d in decisions if RISE_S < d.at_s <= RISE_S + 2 * INTERVAL and d.target["agg"] > before]
    assert grown, "the doubled load should raise the target within two intervals"
    peak = max(d.target["agg"] for d in decisions if RISE_S <= d.at_s < FALL_S)
    late = [d.target["agg"] for d in decisions if d.at_s >= FALL_S + 8 * INTERVAL]
    assert late and max(late) < peak, "the fall should remove replicas after the sustained period"
    first_cut = next(d for d in decisions if d.at_s > FALL_S and any(a.delta < 0 for a in d.actions))
    assert first_cut.at_s >= FALL_S + 3 * INTERVAL  # four decisions must agree first
    assert all(r.finished for r in sim.records.values()) and len(sim.records) == len(requests)
    for d in decisions:
        assert d.reason and (not d.actions or any(a.describe() in d.reason for a in d.actions))
    assert sum(1 for c in sim.change_log if c.action == "add") >= 1
    # the observer's load shape: equal 8k prompts have no spread; the busiest second is whole prompts
    busy = [d.observed for d in decisions if d.observed.requests and d.at_s <= FALL_S]
    assert all(o.isl_cv2 == 0.0 for o in busy if o.requests >= 2)
    assert all(o.peak_prompt_tokens_per_s % 8000 == 0 and o.peak_prompt_tokens_per_s >= 8000 for o in busy)
    assert max(o.peak_prompt_tokens_per_s for o in busy) >= 3 * 8000  # Poisson at 4 req/s bunches up
    # the streams decoding at each whole second, as the frontend samples them, counted by brute force
    for obs in busy[::7]:
        counts = [sum(1 for r in sim.records.values() if r.first_token_s is not None and r.first_token_s <= t
                      and (r.last_token_s is None or t < r.last_token_s or not r.finished))
                  for t in range(int(obs.at_s - INTERVAL) + 1, int(obs.at_s) + 1)]
        assert obs.streams_mean == pytest.approx(np.mean(counts)) and obs.streams_p90 == np.percentile(counts, 90)


def test_planner_simulate_command_with_baselines(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    code = main(["planner", "simulate", "--synthetic", "poisson", "--rate", "1.5", "--duration-s", "300",
                 "--isl", "8000", "--osl", "100", "--model", "llama-3.1-70b", "--gpu", "h100", "--layout", "tp4",
                 "--agg", "1", "--ttft-ms", "1000", "--itl-ms", "50", "--predictor", "constant", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "tokenmill.planner.simulate/1"
    assert report["planned"]["sla_attainment"] > 0.9
    assert report["static_peak"]["sla_attainment"] >= report["planned"]["sla_attainment"]
    assert report["gpu_hours_vs_oracle"] > 0 and report["decisions"][0]["reason"]


def test_bench_planner_puts_modes_and_predictors_beside_the_baselines(tmp_path: Path) -> None:
    """A slice of the shipped Azure conv trace: one row per mode and per predictor, the ratios taken
    against the sla row's baselines, and an oracle no larger than the load needs (an oracle that
    sees no arrivals ahead must not size for prompts of one token)."""
    out = tmp_path / "bench.json"
    code = main(["bench", "planner", "--traces", "azure-conv", "--max-requests", "300", "--rate-scale", "1",
                 "--modes", "sla,load", "--predictors", "constant,moving_average", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["predictor"]) for r in rows] == [("sla", "constant"), ("load", "constant"),
                                                          ("sla", "moving_average")]
    base = rows[0]
    assert base["oracle"]["peak_replicas"] <= 2 * max(base["planned"]["peak_replicas"], 1)
    assert 0.5 < base["gpu_hours_vs_oracle"] < 2.0
    for row in rows:
        assert 0.0 <= row["planned"]["sla_attainment"] <= 1.0 and row["planned"]["requests"] == 300
        assert row["gpu_hours_vs_static"] == pytest.approx(row["planned"]["gpu_hours"]
                                                           / base["static_peak"]["gpu_hours"])


def test_planner_simulate_refuses_bad_flags(capsys) -> None:
    base = ["planner", "simulate", "--synthetic", "poisson", "--model", "llama-3.1-70b", "--gpu", "h100"]
    assert main([*base, "--max-step", "0"]) == 2
    assert "--max-step" in capsys.readouterr().out
    assert main([*base, "--change", "10:add:agg"]) == 2
    assert main([*base, "--prefill", "1"]) == 2
    capsys.readouterr()
    assert main([*base, "--score-from-s", "-1"]) == 2
    assert "--score-from-s" in capsys.readouterr().out
    assert main([*base, "--duration-s", "60", "--score-from-s", "600"]) == 2
    assert "--score-from-s 600: no request arrives that late" in capsys.readouterr().out


def test_a_run_scored_from_a_second_counts_the_requests_and_gpu_time_after_it() -> None:
    config = FleetConfig(profiles={"agg": parse_profile("llama-3.1-8b@h100:fp8:tp1")}, agg=2, sla=SLA(1.0, 0.05))
    requests = synthetic("poisson", rate=2.0, duration_s=120.0, input_tokens=500, output_tokens=20, seed=1)
    sim = FleetSim(config)
    sim.run(requests)
    whole, later = summarize(sim), summarize(sim, since_s=60.0)
    assert later.totals["requests"] == sum(1 for r in requests if r.arrival_s >= 60.0) < whole.totals["requests"]
    end_s = whole.totals["gpu_hours"] * 3600 / 2  # two one-GPU replicas from t = 0
    assert later.totals["gpu_hours"] == pytest.approx(2 * (end_s - 60.0) / 3600)


def test_a_forecaster_warm_started_from_a_trace_predicts_from_the_first_interval(tmp_path: Path) -> None:
    from tokenmill.planner.setup import make_forecaster

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 1000, "input_length": 500, "output_length": 50,
                                         "hash_ids": [i]}) + "\n" for i in range(301)))  # 1 req/s, 300 s
    forecast = make_forecaster("moving_average", str(trace), 30.0).predict()
    assert forecast.requests == 30 and forecast.isl == 500 and forecast.osl == 50
    assert make_forecaster("moving_average").predict().requests == 0


def _burst_then_calm() -> list[TraceRequest]:
    """60 prompts of 4k tokens in the first second, then one every 2 s for 5 minutes."""
    times = [i / 60 for i in range(60)] + [1.0 + 2.0 * i for i in range(150)]
    return [TraceRequest(f"r{i}", t, 4000, 50, (i,)) for i, t in enumerate(times)]


def test_the_oracle_and_the_opening_fleet_know_the_bursts_ahead() -> None:
    import argparse

    from tokenmill.planner.simulate import OracleForecaster, add_arguments, initial_config, provisioned_start

    requests = _burst_then_calm()
    oracle = OracleForecaster(requests, INTERVAL, lookahead_s=60.0)
    assert oracle.predict().peak_prompt_tokens_per_s == 60 * 4000  # the busiest second ahead
    for _ in range(3):
        oracle.observe(0, None, None)
    assert oracle.predict().peak_prompt_tokens_per_s == 4000  # past the burst: one prompt a second at most
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--model", "llama-3.1-70b", "--gpu", "h100", "--layout", "tp4", "--prefill", "1", "--decode", "1",
             "--prefill-layout", "tp4", "--decode-layout", "tp4", "--ttft-ms", "1000"]
    args = parser.parse_args(flags)
    bursty = provisioned_start(initial_config(args), requests, args)
    # the same prompts and the same count per interval, the first 60 spread over the first 30 s
    spread = [dataclasses.replace(r, arrival_s=0.5 * i) if i < 60 else r for i, r in enumerate(requests)]
    calm = provisioned_start(initial_config(parser.parse_args(flags)), spread, parser.parse_args(flags))
    assert bursty.prefill > calm.prefill


def test_bench_planner_hands_the_disaggregated_fleet_its_flags() -> None:
    import argparse

    from tokenmill.bench.fleet.planner_bench import _args_for, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prefill-queue-limit", "64", "--max-num-seqs", "1024", "--ttft-ms", "500"])
    run = _args_for("llama-3.1-70b@h100:fp8:tp2/tp4", "azure-code", args, "hybrid", "kalman")
    assert (run.prefill_layout, run.decode_layout, run.prefill, run.decode) == ("tp2", "tp4", 1, 1)
    assert (run.prefill_queue_limit, run.max_num_seqs, run.ttft_ms, run.planner_mode) == (64, 1024, 500.0, "hybrid")


def test_the_static_baseline_sizes_each_pool_on_its_own() -> None:
    """Long prompts, short answers: many prefill replicas and one decode replica. Searched pool by
    pool, the static fleet keeps one decode replica beside the prefill pool it needs (held to the
    planner's prefill:decode ratio it would be rounded to a multiple), and one replica fewer in
    either pool misses the attainment it was asked for."""
    profile = parse_profile(PROFILE)
    config = FleetConfig(profiles={"prefill": profile, "decode": profile}, prefill=1, decode=1,
                         sla=SLA(1.0, 0.05), interval_s=INTERVAL)
    requests = list(synthetic("poisson", rate=3.0, duration_s=120.0, input_tokens=8000, output_tokens=20, seed=3))

    def attainment(prefill: int, decode: int) -> float:
        sim = FleetSim(dataclasses.replace(config, prefill=prefill, decode=decode))
        sim.run(requests)
        return float(summarize(sim).totals["sla_attainment"])

    sized, result = static_peak(config, requests, 0.95, {"prefill": 4, "decode": 3})
    assert sized.decode == 1 and sized.prefill >= 2
    assert float(result.totals["sla_attainment"]) >= 0.95
    assert attainment(sized.prefill - 1, 1) < 0.95
