"""`sim fleet --plot`: TTFT and ITL over the run, their distributions, and the fleet's size."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tokenmill.sim.fleet.report import FleetResult
from tokenmill.sim.plots import _pyplot


def _cdf(ax, values: np.ndarray, label: str, target: float) -> None:
    if values.size:
        ax.plot(np.sort(values), np.linspace(0, 1, values.size), label=label)
    ax.axvline(target, color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xscale("log")
    ax.set_ylabel("fraction of requests")
    ax.legend(loc="lower right")


def plot_fleet(result: FleetResult, out: Path) -> Path:
    plt = _pyplot()
    served = [r for r in result.records if r.finished and r.ttft_s is not None]
    arrival = np.array([r.arrival_s for r in served])
    ttft_ms = np.array([r.ttft_s * 1e3 for r in served])
    itl = [(r.arrival_s, r.itl_mean_s * 1e3) for r in served if r.itl_mean_s is not None]
    itl_t, itl_ms = (np.array(x) for x in zip(*itl)) if itl else (np.zeros(0), np.zeros(0))
    sla = result.config.sla
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    ax.scatter(arrival, ttft_ms, s=1, alpha=0.3)
    ax.axhline(sla.ttft_s * 1e3, color="red", linewidth=1)
    ax.set(yscale="log", xlabel="arrival (s)", ylabel="TTFT (ms)", title="TTFT over time")
    ax = axes[0][1]
    ax.scatter(itl_t, itl_ms, s=1, alpha=0.3, color="tab:orange")
    ax.axhline(sla.itl_s * 1e3, color="red", linewidth=1)
    ax.set(yscale="log", xlabel="arrival (s)", ylabel="mean ITL (ms)", title="ITL over time")
    _cdf(axes[1][0], ttft_ms, "TTFT (ms)", sla.ttft_s * 1e3)
    _cdf(axes[1][1], itl_ms, "mean ITL (ms)", sla.itl_s * 1e3)
    gpus = np.array([i["gpus"] for i in result.intervals])
    if gpus.size:
        twin = axes[0][0].twinx()
        twin.step([i["start_s"] for i in result.intervals], gpus, where="post", color="tab:green", linewidth=1)
        twin.set_ylabel("GPUs", color="tab:green")
    t = result.totals
    fig.suptitle(f"SLA attainment {t['sla_attainment']:.1%}, goodput {t['goodput_requests_per_s']:.2f} req/s, "
                 f"{t['gpu_hours']:.1f} GPU-h")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
