"""The figures of `tokenmill bench engines`: per side, pooled over its repeats; per comparison, the
first side over the second for every figure, and the targets checked on their own ratios.

Pooling: output tok/s is every run's output tokens over every run's duration (first send to last
stream end), so a long run weighs as much as it lasted; TTFT and ITL percentiles are over all the
runs' requests (ITL: every gap between two token events of one stream) together.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.bench.harness.loadgen import RequestRecord
from tokenmill.bench.harness.serve_stats import SLO, distribution_ms, summarize

SCHEMA_NAME, SCHEMA_VERSION = "tokenmill.bench.engines", 1
# figure -> (column title, format); the ratios cover each of these
FIGURES: dict[str, tuple[str, str]] = {
    "output_tok_s": ("out tok/s", ".1f"), "ttft_ms_p50": ("TTFT p50 ms", ".1f"),
    "ttft_ms_mean": ("TTFT mean ms", ".1f"), "ttft_ms_p99": ("TTFT p99 ms", ".1f"),
    "itl_ms_p50": ("ITL p50 ms", ".1f"), "itl_ms_p99": ("ITL p99 ms", ".1f"),
}
_OPS = {">=": operator.ge, "<=": operator.le}


@dataclass(slots=True, frozen=True)
class Goal:
    """`figure` of side `numerator` over side `denominator` must be `op` `bound`."""
    figure: str
    numerator: str
    denominator: str
    op: str
    bound: float

    @property
    def label(self) -> str:
        return f"{FIGURES[self.figure][0]} {self.numerator} / {self.denominator}"


@dataclass(slots=True)
class RunOutcome:
    """One side's run: what the client saw, reduced to what pooling needs."""
    side: str
    repeat: int
    position: int  # 0 or 1: where in its repeat's pair it ran
    requests_ok: int
    requests_total: int
    outcomes: dict[str, int]
    length_mismatches: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)


def run_outcome(side: str, repeat: int, position: int, records: Sequence[RequestRecord]) -> RunOutcome:
    summary = summarize(records, SLO(), None)
    ok = [r for r in records if r.status == "ok"]
    return RunOutcome(side, repeat, position, summary.requests_ok, summary.requests_total, summary.outcomes,
                      summary.length_mismatches, summary.duration_s, summary.output_tokens,
                      summary.output_token_throughput,
                      [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None],
                      [gap * 1e3 for r in ok for gap in r.itl_s])


def side_figures(runs: Sequence[RunOutcome]) -> dict[str, Any]:
    """One side's runs pooled; a figure no request gave is None."""
    duration = sum(r.duration_s for r in runs)
    ttft = distribution_ms([t / 1e3 for r in runs for t in r.ttft_ms])
    itl = distribution_ms([t / 1e3 for r in runs for t in r.itl_ms])
    return {"runs": len(runs), "requests_ok": sum(r.requests_ok for r in runs),
            "requests_total": sum(r.requests_total for r in runs),
            "length_mismatches": sum(r.length_mismatches for r in runs),
            "output_tokens": sum(r.output_tokens for r in runs), "duration_s": duration,
            "output_tok_s": sum(r.output_tokens for r in runs) / duration if duration > 0 else None,
            **{f"ttft_ms_{k}": getattr(ttft, k) if ttft else None for k in ("p50", "mean", "p99")},
            **{f"itl_ms_{k}": getattr(itl, k) if itl else None for k in ("p50", "p99")}}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def check(goal: Goal, sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    value = ratio(sides.get(goal.numerator, {}).get(goal.figure), sides.get(goal.denominator, {}).get(goal.figure))
    return {"label": goal.label, **asdict(goal), "value": value,
            "met": None if value is None else bool(_OPS[goal.op](value, goal.bound))}


def comparison_report(name: str, sides: dict[str, dict[str, Any]], runs: Sequence[RunOutcome],
                      goals: Sequence[Goal], workload: dict[str, Any], error: str | None) -> dict[str, Any]:
    """`sides`: side name -> its description (command, env); the figures are added here."""
    order = list(sides)
    figures = {s: side_figures([r for r in runs if r.side == s]) for s in order}
    first, second = order
    return {"name": name, "workload": workload, "error": error,
            "sides": {s: {**sides[s], **figures[s]} for s in order},
            "ratio_of": [first, second],
            "ratios": {f: ratio(figures[first][f], figures[second][f]) for f in FIGURES},
            "targets": [check(g, figures) for g in goals],
            "runs": [{k: v for k, v in asdict(r).items() if k != "itl_ms"} for r in runs]}


def complete(report: dict[str, Any]) -> bool:
    """Ran without a server failure, and every request of every run answered in full."""
    sides = report["sides"].values()
    return report["error"] is None and all(
        s["runs"] > 0 and s["requests_ok"] == s["requests_total"] and not s["length_mismatches"] for s in sides)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(report: dict[str, Any], console: Console) -> None:
    w = report["workload"]
    table = Table(title=f"bench engines, {report['name']}: {w['description']}")
    table.add_column("side")
    table.add_column("runs", justify="right")
    table.add_column("ok", justify="right")
    for title, _ in FIGURES.values():
        table.add_column(title, justify="right")
    for side, s in report["sides"].items():
        table.add_row(side, str(s["runs"]), f"{s['requests_ok']}/{s['requests_total']}",
                      *(_cell(s[f], spec) for f, (_, spec) in FIGURES.items()))
    first, second = report["ratio_of"]
    table.add_row(f"{first} / {second}", "", "", *(_cell(report["ratios"][f], ".2f") for f in FIGURES))
    console.print(table)
    for target in report["targets"]:
        verdict = "-" if target["met"] is None else "pass" if target["met"] else "MISS"
        console.print(f"{target['label']} = {_cell(target['value'], '.2f')}x "
                      f"(target {target['op']} {target['bound']:g}: {verdict})")
    if report["error"]:
        console.print(f"[red]{report['name']} stopped: {report['error'].splitlines()[0]}[/red]")


def payload(config: dict[str, Any], reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, "config": config,
            "comparisons": list(reports)}
