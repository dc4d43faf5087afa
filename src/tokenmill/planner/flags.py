"""The planner's command-line flags, importable without the planner (serve parses them at start-up,
and the performance model pulls in the simulator)."""
from __future__ import annotations

import argparse

MODES = ("sla", "load", "hybrid")
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
                   help="size for the load this far ahead: a rising forecast's step carried on "
                        "(default: the replica start-up in the simulator; 0 live)")
    g.add_argument("--forecast-quantile", type=float, default=None,
                   help="size for this quantile of the load given the forecaster's recent errors, e.g. 0.9 "
                        "(default: the point forecast)")
    g.add_argument("--burst-quantile", type=float, default=0.9,
                   help="size the prefill pool for this quantile of the coming interval's busiest second, "
                        "forecast from the last 40 intervals'")
    g.add_argument("--hold-quantile", type=float, default=0.8,
                   help="size each pool for this quantile of its last --hold-window-s of proposals, so bursts "
                        "shorter than a replica start-up are not chased")
    g.add_argument("--hold-window-s", type=float, default=None,
                   help="the proposals held over (default: 10 replica start-ups in the simulator; off live; 0: off)")
    g.add_argument("--fast-path-s", type=float, default=None,
                   help="between intervals, every this many seconds: add replicas at once to a pool whose "
                        "TTFT p90 or queue time is over its target now (default: off)")
    g.add_argument("--warmup-s", type=float, default=60.0,
                   help="a replica's latency corrects the model once it has served this long")
    for role in ("agg", "prefill", "decode"):
        g.add_argument(f"--min-{role}", type=int, default=1,
                       help="0: the pool scales to zero when idle, and back up when a request arrives")
        g.add_argument(f"--max-{role}", type=int, default=None)
    g.add_argument("--scale-to-zero-after-s", type=float, default=300.0,
                   help="a pool with minimum 0 goes to 0 after this long with no request")
    g.add_argument("--gpu-budget", type=int, default=None, help="GPUs across every pool, at most")
    g.add_argument("--power-kw", type=float, default=None, help="kW across every pool, at most")
    g.add_argument("--max-step", type=int, default=4, help="replicas added or removed per pool per decision")
    g.add_argument("--scale-down-intervals", type=int, default=4,
                   help="decisions in a row that must want fewer replicas before any is removed")
    g.add_argument("--scale-down-utilisation", type=float, default=0.8,
                   help="survivors' share of capacity after a removal, at most")


def check_planner_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag: the quantiles in (0, 1); the hold's window off or at least an
    interval; the fast path off or within an interval."""
    check_quantile(args.forecast_quantile, "--forecast-quantile")
    check_quantile(args.burst_quantile, "--burst-quantile")
    check_quantile(args.hold_quantile, "--hold-quantile")
    fast, interval = args.fast_path_s, args.planner_interval_s
    window = args.hold_window_s
    if window is not None and (window < 0 or 0 < window and round(window / interval) < 1):
        raise ValueError(f"--hold-window-s must be 0 (off) or span at least one --planner-interval-s "
                         f"({interval:g}), got {window:g}")
    if fast is not None and not 0 < fast < interval:
        raise ValueError(f"--fast-path-s must be > 0 and shorter than --planner-interval-s ({interval:g}), got {fast:g}")


def check_quantile(quantile: float | None, flag: str) -> None:
    if quantile is not None and not 0.0 < quantile < 1.0:
        raise ValueError(f"{flag} must be in (0, 1), got {quantile}")


def add_serve_planner_arguments(parser: argparse.ArgumentParser) -> None:
    add_planner_arguments(parser, default_mode=None)
    g = parser.add_argument_group("planner targets")
    g.add_argument("--planner-profile", default=None,
                   help="MODEL@GPU[:precision][:layout] of a replica for the planner's model (default: --mock-profile)")
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="the planner's TTFT target")
    g.add_argument("--slo-itl-ms", type=float, default=50.0, help="the planner's ITL target")
