"""The summary, table and text of `tokenmill bench router-warmup` (definitions: router_warmup_bench.py)."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.bench.routing.router_warmup_probe import WarmupRun

TIMES = ("http_up_s", "workers_joined_s", "index_99_s", "first_kv_probe_s")
COUNTS = ("probes_before_kv", "index_at_first_probe", "first_probe_latency_s", "frontend_rss_mib")


def _median(values: Sequence[float | int | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: Sequence[WarmupRun]) -> dict[str, dict[str, Any]]:
    """Per mode: medians over the runs that reached each figure, and the pooled KV-aware fraction."""
    summary: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r.mode for r in runs):
        mine = [r for r in runs if r.mode == mode]
        window = sum(r.window_probes for r in mine)
        summary[mode] = {
            "runs": len(mine),
            "complete": sum(r.index_99_s is not None and r.first_kv_probe_s is not None for r in mine),
            **{f"{name}_median": _median([getattr(r, name) for r in mine]) for name in TIMES + COUNTS},
            **{f"{name}_max": max((v for r in mine if (v := getattr(r, name)) is not None), default=None)
               for name in TIMES},
            "window_probes": window,
            "kv_fraction_in_window": sum(r.window_kv_probes for r in mine) / window if window else None,
        }
    return summary


def _s(value: float | None, spread: float | None = None) -> str:
    if value is None:
        return "never"
    return f"{value:.2f}" if spread is None or spread - value < 0.005 else f"{value:.2f} (max {spread:.2f})"


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def render(report: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 200)  # a log file gets one line per mode
    fleet, window = report["fleet"], report["config"]["probe_window_s"]
    table = Table(title=f"router-warmup: a fresh frontend over {fleet['workers']} mock workers holding "
                        f"{fleet['truth_blocks']:,} cached blocks: seconds from its process start "
                        f"(median of {report['config']['repeats']})",
                  caption="KV-aware probe: routed with overlap > 0 to the worker holding its prefix. "
                          "snapshot: each worker's snapshot asked as it joins; cold: --no-kv-snapshot-on-join "
                          "(a worker's blocks arrive after traffic reaches it)")
    for column in ("mode", "complete", "HTTP up", "workers joined", "index >= 99%", "first KV-aware probe",
                   "probes before it", f"KV-aware in first {window:g} s", "index at 1st probe",
                   "1st probe latency", "RSS MiB"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode, s in report["summary"].items():
        fraction = s["kv_fraction_in_window"]
        table.add_row(mode, f"{s['complete']}/{s['runs']}",
                      *(_s(s[f"{name}_median"], s[f"{name}_max"]) for name in TIMES),
                      _n(s["probes_before_kv_median"]),
                      "-" if fraction is None else f"{100 * fraction:.0f}% of {s['window_probes']}",
                      _n(s["index_at_first_probe_median"]), _s(s["first_probe_latency_s_median"]),
                      _n(s["frontend_rss_mib_median"]))
    console.print(table)
    rate = fleet["fill_blocks_per_s"]
    console.print(f"fill: {fleet['truth_blocks']:,} blocks ({fleet['worker_blocks']}) in {fleet['fill_s']:.1f} s"
                  f"{'' if rate is None else f' ({rate:,.0f} blocks/s)'} over the workers' request plane; "
                  f"the serve frontend's index holds {fleet['first_frontend_index_blocks']:,}: "
                  f"{'verified' if fleet['fill_verified'] else 'NOT as planned'}")
