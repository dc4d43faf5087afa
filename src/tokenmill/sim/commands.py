"""Handlers behind `tokenmill sim …`: parse-free glue between argparse and the simulator."""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from tokenmill.sim.deploy import estimate, make_context
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.pareto import best_under_sla, pareto_mask, usd_per_million_tokens
from tokenmill.sim.search import ModePoints, SearchResult, run_search
from tokenmill.sim.serving import Workload

log = logging.getLogger(__name__)


def _workload(args: argparse.Namespace) -> Workload:
    return Workload(args.isl, args.osl, args.mtp, args.mtp_acceptance)


def estimate_cmd(args: argparse.Namespace) -> int:
    c = make_context(args.model, args.gpu, args.precision, args.kv_precision, args.backend)
    est = estimate(c, Parallel.of(args.tp, args.pp, args.ep, args.dp), _workload(args), args.batch)
    if args.json:
        print(dump_json(est.to_json(), None))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.model} on {args.gpu} tp{args.tp} pp{args.pp} ep{args.ep} dp{args.dp} batch {args.batch}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in est.to_json().items():
        table.add_row(key, f"{value:.2f}" if isinstance(value, float) else str(value))
    Console().print(table)
    return 0


def _frontier(points: ModePoints, ttft_limit: float | None) -> list[dict[str, float]]:
    ok = points.feasible & np.isfinite(points.tps_gpu)
    if ttft_limit is not None:
        ok &= points.ttft <= ttft_limit
    idx = np.flatnonzero(ok)
    keep = idx[pareto_mask(points.tps_user[idx], points.tps_gpu[idx])]
    return [points.describe(int(i)) for i in keep[np.argsort(points.tps_user[keep])]]


def search_cmd(args: argparse.Namespace) -> int:
    c = make_context(args.model, args.gpu, args.precision, args.kv_precision, args.backend)
    res = run_search(c, _workload(args), args.gpus)
    if args.power_cap_kw is not None:
        _apply_power_cap(res, c.gpu.power_w, args.power_cap_kw)
    ttft_s = args.ttft_ms / 1e3 if args.ttft_ms else None
    itl_s = args.itl_ms / 1e3 if args.itl_ms else None
    out: dict[str, object] = {"model": args.model, "gpu": args.gpu, "gpus": args.gpus, "isl": args.isl, "osl": args.osl,
                              "power_cap_kw": args.power_cap_kw,
                              "points_evaluated": res.points_evaluated, "seconds": res.seconds,
                              "points_per_second": res.points_evaluated / res.seconds, "frontier": {}, "best": {}}
    for mode, points in (("agg", res.agg), ("disagg", res.disagg)):
        out["frontier"][mode] = _frontier(points, ttft_s)
        i = best_under_sla(points.tps_gpu, points.ttft, points.tpot, points.feasible, ttft_s, itl_s)
        if i is not None:
            best = points.describe(i)
            best["usd_per_million_tokens"] = usd_per_million_tokens(best["output_tokens_per_s_per_gpu"], args.usd_per_gpu_hour)
            out["best"][mode] = best
    modes = [m for m in ("agg", "disagg") if m in out["best"]]
    out["best"]["overall"] = max(modes, key=lambda m: out["best"][m]["output_tokens_per_s_per_gpu"]) if modes else None
    if args.json_out:
        dump_json(out, args.json_out)
    if args.plot:
        _plot_search(out, args)
    _print_search(out)
    return 0


def _apply_power_cap(res: SearchResult, watts_per_gpu: float, cap_kw: float) -> None:
    """Power is a constraint, not the objective: designs drawing more than the cap are infeasible."""
    if cap_kw <= 0:
        raise ValueError(f"--power-cap-kw must be > 0, got {cap_kw:g}")
    for points in (res.agg, res.disagg):
        points.feasible = points.feasible & (points.detail["gpus"] * watts_per_gpu <= cap_kw * 1e3)


def _plot_search(out: dict, args: argparse.Namespace) -> None:
    from tokenmill.sim.plots import plot_frontiers

    curves = []
    for mode in ("agg", "disagg"):
        pts = out["frontier"][mode]
        curves.append((mode, np.array([p["tokens_per_s_per_user"] for p in pts]),
                       np.array([p["output_tokens_per_s_per_gpu"] for p in pts])))
    title = f"{args.model} on {args.gpus}x{args.gpu} {args.precision}, ISL {args.isl} / OSL {args.osl}"
    plot_frontiers(curves, title, args.plot)


def _print_search(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"evaluated {out['points_evaluated']:,} design points in {out['seconds']:.2f} s "
                  f"({out['points_per_second']:,.0f} points/s)")
    table = Table(title="best deployment under the SLA")
    for col in ("mode", "tok/s/GPU", "tok/s/user", "TTFT ms", "TPOT ms", "GPUs", "$/M tok"):
        table.add_column(col, justify="right")
    for mode in ("agg", "disagg"):
        b = out["best"].get(mode)
        if b:
            table.add_row(mode, f"{b['output_tokens_per_s_per_gpu']:.0f}", f"{b['tokens_per_s_per_user']:.1f}",
                          f"{b['ttft_ms']:.0f}", f"{b['tpot_ms']:.1f}", f"{b['gpus']:.0f}", f"{b['usd_per_million_tokens']:.3f}")
    console.print(table)


def report_cmd(args: argparse.Namespace) -> int:
    from tokenmill.sim.report import write_report

    path = write_report(args.out)
    print(f"wrote {path}")
    return 0


def validate_cmd(args: argparse.Namespace) -> int:
    from tokenmill.sim.validate import print_validation, run_validation

    result = run_validation(args.data, refit=args.refit, fitted_out=args.fitted_out)
    print_validation(result)
    if args.json_out:
        dump_json(result.to_json(), args.json_out)
    return result.exit_code  # 1 when any check fails


def calibrate_cmd(args: argparse.Namespace) -> int:
    from tokenmill.sim.local_calibrate import calibrate_local

    path = calibrate_local(args.out, quick=args.quick, model=args.model, threads=args.threads)
    print(f"wrote {path}")
    return 0


def dump_json(obj: object, path: Path | None) -> str:
    text = json.dumps(obj, indent=2)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    return text
