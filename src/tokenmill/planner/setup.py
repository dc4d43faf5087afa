"""Building a planner from flags: the predictor, the performance models of the pools, the limits.

Shared by `tokenmill planner simulate`, `tokenmill bench planner` and (for the live connector)
`tokenmill planner run`, so every entry point plans with the same code and the same defaults.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Mapping

from tokenmill.planner.constrain import Constrainer, Limits
from tokenmill.planner.flags import PREDICTORS
from tokenmill.planner.hold import LevelHold
from tokenmill.planner.perf_model import ReplicaModel
from tokenmill.planner.planner import Forecaster, Planner
from tokenmill.planner.propose import Proposer
from tokenmill.sim.fleet.clock import Profile, StepClock

HOLD_STARTUPS = 10  # the hold's default window: a swing of a few start-ups is one it should not chase


def hold_from(args: argparse.Namespace, replica_startup_s: float | None = None) -> tuple[float, int] | None:
    """`LevelHold`'s (quantile, intervals) from --hold-quantile and --hold-window-s; the window
    defaults to HOLD_STARTUPS replica start-ups where the start-up is known (the simulator), else
    off (live: the start-up is the deployment's own). None: off. The flags are checked beforehand
    (`check_planner_flags`)."""
    window_s = args.hold_window_s
    if window_s is None:
        window_s = HOLD_STARTUPS * replica_startup_s if replica_startup_s else 0.0
    intervals = round(window_s / args.planner_interval_s)
    return (args.hold_quantile, intervals) if intervals >= 1 else None


def limits_from(args: argparse.Namespace) -> Limits:
    roles = ("agg", "prefill", "decode")
    if not args.scale_to_zero_after_s > 0:
        raise ValueError(f"--scale-to-zero-after-s must be > 0, got {args.scale_to_zero_after_s:g}")
    return Limits(min_replicas={r: getattr(args, f"min_{r}") for r in roles},
                  max_replicas={r: getattr(args, f"max_{r}") for r in roles if getattr(args, f"max_{r}") is not None},
                  gpu_budget=args.gpu_budget, power_kw=args.power_kw, max_step=args.max_step,
                  scale_down_intervals=args.scale_down_intervals, scale_down_utilisation=args.scale_down_utilisation,
                  zero_after_intervals=max(math.ceil(args.scale_to_zero_after_s / args.planner_interval_s - 1e-9), 1))


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
                 kv_tokens: Mapping[str, int] | None = None, lookahead_intervals: float = 0.0,
                 forecast_quantile: float | None = None, burst_quantile: float | None = None,
                 hold: tuple[float, int] | None = None) -> Planner:
    """`hold`: (quantile, intervals) of `LevelHold`, or None to plan on each interval's proposal."""
    roles = ("prefill", "decode") if disaggregated else ("agg",)
    models = {role: ReplicaModel(StepClock(profiles[role]), ttft_s, itl_s, max_num_seqs, max_num_batched_tokens,
                                 (kv_tokens or {}).get(role)) for role in roles}
    watts = max(m.clock.context.gpu.power_w for m in models.values())
    constrainer = Constrainer(limits, {role: m.gpus for role, m in models.items()}, watts)
    proposer = Proposer(models, disaggregated, mode, burst_quantile, LevelHold(*hold) if hold else None)
    return Planner(forecaster, proposer, constrainer,
                   lookahead_intervals=lookahead_intervals, forecast_quantile=forecast_quantile)
