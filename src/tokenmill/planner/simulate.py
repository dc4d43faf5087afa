"""`tokenmill planner simulate`: the planner sizing a simulated fleet over a trace, with baselines.

    tokenmill planner simulate --trace azure-conv --rate-scale 8 --model llama-3.1-70b --gpu h100 \\
        --agg 2 --layout tp4 --ttft-ms 1000 --itl-ms 50 --json out.json --plot out.png

The fleet starts sized for the trace's opening load, as one already running when the trace
begins would be (`--cold-start`: as given by `--agg N` or `--prefill P --decode D`), and the
planner resizes it every `--planner-interval-s`. Beside it, two baselines on the same trace:
- static peak: the smallest fixed fleet whose SLA attainment over the trace (from --score-from-s
  on, as every run here is scored) reaches the planner's, found by bisection in the simulator,
  one pool at a time;
- oracle: the same planner told the true load of the coming intervals (up to one start-up
  delay ahead) instead of a forecast, scaling down at once and following each interval (no level
  hold, `planner/hold.py`): what knowing the future buys.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.planner.decision import Decision
from tokenmill.planner.flags import add_planner_arguments, check_planner_flags
from tokenmill.planner.observation import Observation
from tokenmill.planner.planner import Forecaster
from tokenmill.planner.setup import hold_from, limits_from, make_forecaster, make_planner
from tokenmill.planner.simulated import SimulatedDeployment, observe_arrivals
from tokenmill.sim.fleet.arrivals import TraceRequest
from tokenmill.sim.fleet.config import FleetConfig
from tokenmill.sim.fleet.fleet import FleetSim
from tokenmill.sim.fleet.report import FleetResult, summarize

SCHEMA = "tokenmill.planner.simulate/1"
MAX_STATIC_REPLICAS = 4096


@dataclass(slots=True)
class PlannedRun:
    result: FleetResult
    decisions: list[Decision] = field(default_factory=list)

    @property
    def attainment(self) -> float:
        return float(self.result.totals["sla_attainment"])  # type: ignore[arg-type]

    @property
    def gpu_hours(self) -> float:
        return float(self.result.totals["gpu_hours"])  # type: ignore[arg-type]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.sim.fleet.cli import add_fleet_arguments

    add_fleet_arguments(parser)
    add_planner_arguments(parser)
    parser.add_argument("--no-baselines", action="store_true", help="skip the static-peak and oracle runs")
    parser.add_argument("--score-from-s", type=float, default=0.0,
                        help="score every run (planned, oracle, static) on the requests arriving from this second "
                             "on and the GPU-time after it: the planner's warm-up left out")
    parser.add_argument("--cold-start", dest="provision_start", action="store_false",
                        help="start from --agg/--prefill/--decode as given, not from the fleet the opening load needs")


def initial_config(args: argparse.Namespace) -> FleetConfig:
    from tokenmill.sim.fleet.cli import build_config

    if not (args.agg or args.prefill or args.decode):
        args.agg = max(args.min_agg, 1)
    if (args.prefill or args.decode) and not (args.prefill and args.decode):
        raise ValueError("--prefill/--decode: a planned disaggregated fleet starts with both pools")
    if args.change:
        raise ValueError("--change: the planner makes the fleet's changes")
    if not args.score_from_s >= 0:
        raise ValueError(f"--score-from-s must be >= 0, got {args.score_from_s:g}")
    check_planner_flags(args)
    return build_config(args)


def provisioned_start(config: FleetConfig, requests: list[TraceRequest], args: argparse.Namespace) -> FleetConfig:
    """The fleet sized for the trace's opening load, as a deployment already running when the
    trace begins would be: what the planner proposes for the busiest interval within one start-up
    delay of t = 0 (the oracle's view, which includes that window's busiest second), with the
    prompts' spread of that window, within the limits' minimums."""
    oracle = OracleForecaster(requests, args.planner_interval_s, config.replica_startup_s)
    planner = make_planner(config.profiles, config.disaggregated, "sla", oracle, limits_from(args), config.sla.ttft_s,
                           config.sla.itl_s, config.max_num_seqs, config.max_num_batched_tokens, _kv_tokens(config))
    window_s = oracle.ahead * args.planner_interval_s
    opening = observe_arrivals(Observation(at_s=0.0, interval_s=window_s),
                               [r for r in requests if r.arrival_s < window_s])
    planner.proposer.shape.update(opening)
    obs = Observation(at_s=0.0, interval_s=args.planner_interval_s)
    wanted = planner.proposer.predictive(oracle.predict(), obs).replicas
    sizes = {role: max(n, limits_from(args).minimum(role)) for role, n in wanted.items()}
    return dataclasses.replace(config, **sizes)


def run_planned(config: FleetConfig, requests: list[TraceRequest], args: argparse.Namespace,
                forecaster: Forecaster | None = None, oracle: bool = False) -> PlannedRun:
    limits = limits_from(args)
    if oracle:  # knowing the future, nothing to wait for before scaling down
        limits = dataclasses.replace(limits, scale_down_intervals=1, max_step=MAX_STATIC_REPLICAS,
                                     zero_after_intervals=1)
    forecaster = forecaster or make_forecaster(args.predictor, args.warm_start_trace, args.planner_interval_s)
    # a replica asked for now serves after its start-up: size for then (the oracle sees that far itself)
    lookahead_s = args.lookahead_s if args.lookahead_s is not None else config.replica_startup_s
    lookahead_s = 0.0 if oracle else lookahead_s
    planner = make_planner(config.profiles, config.disaggregated, args.planner_mode, forecaster, limits,
                           config.sla.ttft_s, config.sla.itl_s, config.max_num_seqs, config.max_num_batched_tokens,
                           _kv_tokens(config), lookahead_s / args.planner_interval_s,
                           None if oracle else args.forecast_quantile, args.burst_quantile,
                           hold=None if oracle else hold_from(args, config.replica_startup_s))
    deployment = SimulatedDeployment(planner, args.planner_interval_s, args.warmup_s,
                                     None if oracle else args.fast_path_s)
    sim = FleetSim(config)
    sim.run(requests, controller=deployment.tick, tick_s=deployment.tick_s, wake=deployment.wake)
    return PlannedRun(summarize(sim, args.score_from_s), deployment.decisions)


def _kv_tokens(config: FleetConfig) -> dict[str, int] | None:
    if config.kv_blocks is None:
        return None
    return {role: config.kv_blocks * config.block_size for role in ("agg", "prefill", "decode")}


class OracleForecaster:
    """The true load instead of a forecast: the busiest interval within one start-up delay ahead
    (a replica asked for now serves only then), with that interval's mean ISL and OSL, and the
    busiest second of that whole window (so the oracle's prefill pool is sized for the bursts
    to come, not for those of the past)."""

    def __init__(self, requests: list[TraceRequest], interval_s: float, lookahead_s: float) -> None:
        self.interval_s = interval_s
        self.ahead = max(1, math.ceil(lookahead_s / interval_s) + 1)
        self.buckets: dict[int, list[TraceRequest]] = {}
        for r in requests:
            self.buckets.setdefault(int(r.arrival_s // interval_s), []).append(r)
        self.index = 0

    def observe(self, requests: float, isl: float | None, osl: float | None) -> None:
        self.index += 1

    def predict(self) -> Any:
        from tokenmill.planner.predict import LoadForecast

        window = [self.buckets.get(self.index + k, []) for k in range(self.ahead)]
        busiest = max(window, key=len)
        if not busiest:
            return LoadForecast(0.0, 1.0, 1.0, "oracle")
        isl = sum(r.input_tokens for r in busiest) / len(busiest)
        osl = sum(r.output_tokens for r in busiest) / len(busiest)
        coming = observe_arrivals(Observation(at_s=0.0, interval_s=self.interval_s), [r for w in window for r in w])
        return LoadForecast(float(len(busiest)), isl, osl, "oracle", coming.peak_prompt_tokens_per_s)


def static_peak(config: FleetConfig, requests: list[TraceRequest], attainment: float,
                peak: dict[str, int], since_s: float = 0.0) -> tuple[FleetConfig, FleetResult]:
    """The smallest fixed fleet reaching `attainment`, one pool at a time: from the planner's peak
    `peak` (doubled until the fleet reaches it), the smallest decode pool with that prefill pool,
    then the smallest prefill pool with that decode pool (aggregated: the one pool). Each pool
    has its own count, so a small pool beside a large one is not rounded to a multiple of it.
    Scored from `since_s` on, as the planned run is."""
    roles = ("prefill", "decode") if config.disaggregated else ("agg",)
    sizes = {role: max(peak.get(role, 1), 1) for role in roles}

    def reaches(candidate: dict[str, int]) -> FleetResult | None:
        sim = FleetSim(dataclasses.replace(config, **candidate, changes=()))
        sim.run(requests)
        result = summarize(sim, since_s)
        return result if float(result.totals["sla_attainment"]) >= attainment else None  # type: ignore[arg-type]

    best = reaches(sizes)
    while best is None and max(sizes.values()) < MAX_STATIC_REPLICAS:  # the peak held fixed was not enough
        sizes = {role: n * 2 for role, n in sizes.items()}
        best = reaches(sizes)
    if best is None:
        raise ValueError(f"no fixed fleet up to {MAX_STATIC_REPLICAS} replicas reaches {attainment:.2%} attainment")
    for role in reversed(roles):  # decode first: its size hardly changes what the prefill pool needs
        sizes[role], best = _smallest(lambda n: reaches({**sizes, role: n}), sizes[role], best)
    return dataclasses.replace(config, **sizes, changes=()), best


def _smallest(reaches: Callable[[int], FleetResult | None], high: int,
              best: FleetResult) -> tuple[int, FleetResult]:
    """The smallest n in [1, high] that `reaches` (which `high` does, giving `best`), by halving
    down from `high` and then bisecting: a fleet far too small is a slow simulation of long queues."""
    low = high // 2
    while low >= 1 and (found := reaches(low)) is not None:
        high, best, low = low, found, low // 2
    while high - low > 1:
        mid = (low + high) // 2
        found = reaches(mid)
        if found is not None:
            high, best = mid, found
        else:
            low = mid
    return high, best


def peak_fleet(decisions: list[Decision]) -> dict[str, int]:
    """Each pool's largest target over the run."""
    peak: dict[str, int] = {}
    for decision in decisions:
        for role, n in decision.target.items():
            peak[role] = max(peak.get(role, 0), n)
    return peak


def plan_over(args: argparse.Namespace) -> tuple[FleetConfig, list[TraceRequest], PlannedRun]:
    """The run `args` ask for: its starting fleet (sized for the opening load unless --cold-start),
    its requests, and the planner sizing the fleet over them."""
    from tokenmill.sim.fleet.cli import load_requests

    config = initial_config(args)
    requests = load_requests(args)
    if args.score_from_s and not any(r.arrival_s >= args.score_from_s for r in requests):
        raise ValueError(f"--score-from-s {args.score_from_s:g}: no request arrives that late")
    if args.provision_start:
        config = provisioned_start(config, requests, args)
    return config, requests, run_planned(config, requests, args)


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    """The planned run and (unless --no-baselines) both baselines, as the report's JSON."""
    config, requests, planned = plan_over(args)
    report: dict[str, Any] = {"schema": SCHEMA, "mode": args.planner_mode, "predictor": args.predictor,
                              "planned": summary(planned), "decisions": [d.to_json() for d in planned.decisions]}
    if not args.no_baselines:
        oracle = run_planned(config, requests, args, OracleForecaster(requests, args.planner_interval_s,
                                                                      config.replica_startup_s), oracle=True)
        static_config, static = static_peak(config, requests, planned.attainment, peak_fleet(planned.decisions),
                                            args.score_from_s)
        report["oracle"] = summary(oracle)
        report["static_peak"] = {**_totals(static), "fleet": {r: getattr(static_config, r)
                                                              for r in ("agg", "prefill", "decode")}}
        report["gpu_hours_vs_oracle"] = planned.gpu_hours / max(oracle.gpu_hours, 1e-9)
        static_hours = float(static.totals["gpu_hours"])  # type: ignore[arg-type]
        report["gpu_hours_vs_static"] = planned.gpu_hours / max(static_hours, 1e-9)
    return report


def summary(run: PlannedRun) -> dict[str, Any]:
    changes = sum(1 for d in run.decisions if d.actions)
    peak = max((sum(d.target.values()) for d in run.decisions), default=0)
    return {**_totals(run.result), "decisions": len(run.decisions), "decisions_with_changes": changes,
            "peak_replicas": peak, "intervals": run.result.intervals}


def _totals(result: FleetResult) -> dict[str, Any]:
    keys = ("requests", "finished", "rejected", "sla_attainment", "gpu_hours", "peak_gpus", "ttft_s_p50",
            "ttft_s_p90", "ttft_s_p99", "itl_mean_s_p50", "itl_mean_s_p90", "itl_mean_s_p99", "ttft_miss_share",
            "itl_miss_share", "cost_usd",
            "usd_per_million_output_tokens", "goodput_requests_per_s")
    return {k: result.totals.get(k) for k in keys}


def run(args: argparse.Namespace) -> int:
    from tokenmill.planner.simulate_report import print_report, write_outputs

    try:
        report = simulate(args)
        write_outputs(report, args)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    print_report(report)
    return 0
