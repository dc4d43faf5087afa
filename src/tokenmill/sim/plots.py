"""PNG plots (matplotlib imported lazily so the CLI stays fast)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_frontiers(curves: Sequence[tuple[str, np.ndarray, np.ndarray]], title: str, out: Path,
                   clouds: Sequence[tuple[str, np.ndarray, np.ndarray]] = ()) -> Path:
    """Frontier lines (label, tokens/s/user, tokens/s/GPU) over optional faint point clouds."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for label, x, y in clouds:
        ax.scatter(x, y, s=2, alpha=0.15, label=f"{label} points")
    for label, x, y in curves:
        order = np.argsort(x)
        ax.plot(x[order], y[order], marker="o", markersize=3, linewidth=2, label=label)
    ax.set_xlabel("tokens/s/user (1 / TPOT)")
    ax.set_ylabel("output tokens/s/GPU")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, out)


def plot_lines(series: Sequence[tuple[str, np.ndarray, np.ndarray]], title: str, xlabel: str, ylabel: str, out: Path,
               logx: bool = False) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, x, y in series:
        ax.plot(x, y, marker="o", linewidth=2, label=label)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, out)


def _save(fig, plt, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
