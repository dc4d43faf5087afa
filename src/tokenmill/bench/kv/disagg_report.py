"""The rich tables `tokenmill bench disagg` prints from its JSON report (one column per arm,
then the disaggregated ÷ aggregated ratios against the targets)."""
from __future__ import annotations

from typing import Any

from tokenmill.bench.kv.disagg_workload import LONG, SHORT


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    arms = report["arms"]
    w = report["workload"]
    table = Table(title=f"tokenmill bench disagg — {w['num_requests']} requests ({w['long_requests']} long), "
                        f"{report['config']['rate']} req/s")
    table.add_column("figure")
    for name in arms:
        table.add_column(name, justify="right")
    for label, cell in _ROWS:
        table.add_row(label, *(cell(arm) for arm in arms.values()))
    console = Console()
    console.print(table)
    if report["comparison"] is not None:
        console.print(_comparison_table(report["comparison"]))


def _ms(dist: dict[str, float] | None) -> str:
    return "-" if dist is None else f"{dist['p50']:.1f} / {dist['p99']:.1f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _outcomes(arm: dict[str, Any]) -> str:
    r = arm["results"]
    failed = r["requests_total"] - r["requests_ok"]
    extra = "" if not failed else " (" + ", ".join(f"{k} {v}" for k, v in r["outcomes"].items() if k != "ok") + ")"
    return f"{r['requests_ok']} / {failed}{extra}"


def _cpu(arm: dict[str, Any]) -> str:
    workers = arm["load"]["worker_cpu_utilization"]
    return "\n".join(f"{name} {value:.2f}" for name, value in workers.items()) or "-"


def _events(arm: dict[str, Any]) -> str:
    events = arm["load"]["server_events"]
    return "-" if events is None else f"{events['worker_drops']} / {events['migrations']}"


def _decisions(arm: dict[str, Any]) -> str:
    if arm["disagg_decisions"] is None:
        return "-"
    return "\n".join(f"{d['decision']}/{d['reason']} {d['count']}" for d in arm["disagg_decisions"]) or "-"


_ROWS: tuple[tuple[str, Any], ...] = (
    ("serve flags", lambda a: " ".join(a["serve_flags"])),
    ("completed / failed", _outcomes),
    ("TTFT p50 / p99 ms", lambda a: _ms(a["results"]["ttft_ms"])),
    ("  long prompts", lambda a: _ms(a["by_class"][LONG]["ttft_ms"])),
    ("  short prompts", lambda a: _ms(a["by_class"][SHORT]["ttft_ms"])),
    ("ITL p50 / p99 ms", lambda a: _ms(a["results"]["itl_ms"])),
    ("output tokens / s", lambda a: f"{a['results']['output_token_throughput']:.1f}"),
    ("duration / drain s", lambda a: f"{a['results']['duration_s']:.1f} / {a['load']['drain_s']:.1f}"),
    ("mean requests in flight", lambda a: f"{a['load']['mean_in_flight']:.1f}"),
    ("short TTFT late ÷ early", lambda a: _fmt(a["load"]["short_ttft_late_over_early"], ".2f")),
    ("worker CPU (cores)", _cpu),
    ("frontend / client CPU (cores)", lambda a: f"{_fmt(a['load']['frontend_cpu_utilization'], '.2f')} / "
                                                f"{_fmt(a['load']['client_cpu_utilization'], '.2f')}"),
    ("other processes' CPU (cores)", lambda a: _fmt(a["load"]["other_processes_cpu_cores"], ".2f")),
    ("worker drops / migrations", _events),
    ("disagg decisions", _decisions),
)


def _comparison_table(c: dict[str, Any]) -> Any:
    from rich.table import Table

    def verdict(met: bool) -> str:
        return "[green]met[/green]" if met else "[red]not met[/red]"

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    table = Table(title="disaggregated ÷ aggregated")
    for column in ("figure", "ratio", "target", "verdict"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    table.add_row("p99 ITL", fmt(c["p99_itl_ratio"]), f"≤ {c['p99_itl_target_max']}", verdict(c["p99_itl_met"]))
    table.add_row("output tokens / s", fmt(c["output_tokens_per_s_ratio"]),
                  f"≥ {c['output_tokens_per_s_target_min']}", verdict(c["output_tokens_per_s_met"]))
    return table


# --------------------------------------------------------------------------- command
