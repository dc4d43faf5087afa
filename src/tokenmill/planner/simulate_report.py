"""`planner simulate`'s output: a table of the planned run beside its baselines, the JSON, a plot
of replicas by role, load and latency over time."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"planner simulate: mode {report['mode']}, predictor {report['predictor']}")
    for column in ("run", "SLA attainment", "TTFT / ITL misses", "GPU-hours", "peak GPUs", "TTFT p90 ms",
                   "ITL p90 ms", "$/M out tok"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name in ("planned", "oracle", "static_peak"):
        row = report.get(name)
        if row is None:
            continue
        label = name if name != "static_peak" else f"static peak {_fleet(row['fleet'])}"
        table.add_row(label, f"{row['sla_attainment']:.2%}", misses(row), f"{row['gpu_hours']:.1f}",
                      str(row["peak_gpus"]), _ms(row["ttft_s_p90"]), _ms(row["itl_mean_s_p90"]), _usd(row["usd_per_million_output_tokens"]))
    console = Console()
    console.print(table)
    if "gpu_hours_vs_oracle" in report:
        console.print(f"GPU-hours: {report['gpu_hours_vs_oracle']:.2f}x the oracle, "
                      f"{report['gpu_hours_vs_static']:.2f}x static peak provisioning")
    planned = report["planned"]
    console.print(f"{planned['decisions_with_changes']} of {planned['decisions']} decisions changed the fleet")


def write_outputs(report: dict[str, Any], args: argparse.Namespace) -> None:
    from tokenmill.sim.fleet.cli import write_json_atomically

    try:
        if args.json_out:
            write_json_atomically(report, args.json_out)
        if args.plot:
            plot(report, args.plot)
    except OSError as exc:
        raise ValueError(f"--json/--plot: cannot write ({exc})") from exc


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decisions = report["decisions"]
    t = [d["at_s"] / 60 for d in decisions]
    fig, (ax_n, ax_load, ax_lat) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for role in sorted({r for d in decisions for r in d["target"]}):
        ax_n.step(t, [d["target"].get(role, 0) for d in decisions], where="post", label=role)
    ax_n.set_ylabel("replicas (target)")
    ax_n.legend()
    ax_load.plot(t, [d["observed"]["requests"] or 0 for d in decisions], label="arrived")
    ax_load.plot(t, [(d["forecast"] or {}).get("requests", 0) for d in decisions], label="forecast", ls="--")
    ax_load.set_ylabel("requests / interval")
    ax_load.legend()
    ax_lat.plot(t, [_nan(d["observed"]["ttft_p90_s"]) for d in decisions], label="TTFT p90 (s)")
    ax_lat.plot(t, [_nan(d["observed"]["itl_p90_s"]) * 10 for d in decisions], label="ITL p90 (s x 10)")
    ax_lat.set_ylabel("latency")
    ax_lat.set_xlabel("minutes")
    ax_lat.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def misses(row: dict[str, Any]) -> str:
    """The shares of requests over the TTFT and over the ITL target (which one the misses broke)."""
    return f"{row.get('ttft_miss_share') or 0.0:.2%} / {row.get('itl_miss_share') or 0.0:.2%}"


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _usd(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _fleet(fleet: dict[str, int]) -> str:
    return "(" + ", ".join(f"{n} {role}" for role, n in fleet.items() if n) + ")"
