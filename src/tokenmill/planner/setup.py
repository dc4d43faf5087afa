"""Building a planner from flags: the predictor, the performance models of the pools, the limits.

Shared by `tokenmill planner simulate`, `tokenmill bench planner` and (for the live connector)
`tokenmill planner run`, so every entry point plans with the same code and the same defaults.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping

from tokenmill.planner.constrain import Constrainer, Limits
from tokenmill.planner.perf_model import ReplicaModel
from tokenmill.planner.planner import Forecaster, Planner
from tokenmill.planner.propose import MODES, Proposer
from tokenmill.sim.fleet.clock import Profile, StepClock

PREDICTORS = ("constant", "moving_average", "arima", "kalman")


def add_planner_arguments(parser: argparse.ArgumentParser, default_mode: str | None = "sla") -> None:
    """The planner's flags; `default_mode` None: no planner unless --planner is given (serve)."""
    g = parser.add_argument_group("planner")
    g.add_argument("--planner", dest="planner_mode", choices=MODES, default=default_mode,
                   help="sla: forecast + performance model; load: latency/KV signals, +-1; hybrid: both")
    g.add_argument("--predictor", choices=PREDICTORS, default="kalman", help="the load forecaster")
    g.add_argument("--planner-interval-s", type=float, default=30.0, help="how often the planner decides")
    g.add_argument("--warm-start-trace", default=None,
                   help="feed the predictor this trace's history first (a path, or mooncake/azure-conv/azure-code)")
    g.add_argument("--lookahead-s", type=float, default=None,
                   help="size for the load this far ahead: a rising forecast's step carried on (default 0)")
    g.add_argument("--warmup-s", type=float, default=60.0,
                   help="a replica's latency corrects the model once it has served this long")
    for role in ("agg", "prefill", "decode"):
        g.add_argument(f"--min-{role}", type=int, default=1)
        g.add_argument(f"--max-{role}", type=int, default=None)
    g.add_argument("--gpu-budget", type=int, default=None, help="GPUs across every pool, at most")
    g.add_argument("--power-kw", type=float, default=None, help="kW across every pool, at most")
    g.add_argument("--max-step", type=int, default=4, help="replicas added or removed per pool per decision")
    g.add_argument("--scale-down-intervals", type=int, default=4,
                   help="decisions in a row that must want fewer replicas before any is removed")
    g.add_argument("--scale-down-utilisation", type=float, default=0.8,
                   help="survivors' share of capacity after a removal, at most")


def limits_from(args: argparse.Namespace) -> Limits:
    roles = ("agg", "prefill", "decode")
    return Limits(min_replicas={r: getattr(args, f"min_{r}") for r in roles},
                  max_replicas={r: getattr(args, f"max_{r}") for r in roles if getattr(args, f"max_{r}") is not None},
                  gpu_budget=args.gpu_budget, power_kw=args.power_kw, max_step=args.max_step,
                  scale_down_intervals=args.scale_down_intervals, scale_down_utilisation=args.scale_down_utilisation)


def make_forecaster(name: str, warm_trace: str | None = None, interval_s: float = 30.0) -> Forecaster:
    """The predictor; with `warm_trace`, it has already seen that trace's per-interval history."""
    from tokenmill.planner.predict import LoadPredictor

    if name not in PREDICTORS:
        raise ValueError(f"--predictor must be one of {', '.join(PREDICTORS)}, got {name!r}")
    predictor = LoadPredictor(name)
    if warm_trace is not None:
        from tokenmill.planner.backtest import bucket_arrivals, resolve_trace
        from tokenmill.sim.fleet.arrivals import load_trace

        rows = load_trace(resolve_trace(warm_trace))
        buckets = bucket_arrivals([r.arrival_s for r in rows], [r.input_tokens for r in rows],
                                  [r.output_tokens for r in rows], interval_s)
        predictor.warm_start(buckets.requests, buckets.isl, buckets.osl)
    return predictor


def make_planner(profiles: Mapping[str, Profile], disaggregated: bool, mode: str, forecaster: Forecaster,
                 limits: Limits, ttft_s: float, itl_s: float, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_tokens: Mapping[str, int] | None = None, lookahead_intervals: float = 0.0) -> Planner:
    roles = ("prefill", "decode") if disaggregated else ("agg",)
    models = {role: ReplicaModel(StepClock(profiles[role]), ttft_s, itl_s, max_num_seqs, max_num_batched_tokens,
                                 (kv_tokens or {}).get(role)) for role in roles}
    watts = max(m.clock.context.gpu.power_w for m in models.values())
    constrainer = Constrainer(limits, {role: m.gpus for role, m in models.items()}, watts)
    return Planner(forecaster, Proposer(models, disaggregated, mode), constrainer,
                   lookahead_intervals=lookahead_intervals)
