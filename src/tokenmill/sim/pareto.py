"""Pareto frontier of output tokens/s/GPU vs tokens/s/user, and SLA-constrained selection."""
from __future__ import annotations

import numpy as np


def pareto_mask(tps_user: np.ndarray, tps_gpu: np.ndarray) -> np.ndarray:
    """Points no other point beats on both axes (higher is better on both)."""
    order = np.lexsort((-tps_gpu, -tps_user))  # by tps_user desc, ties: tps_gpu desc
    best_so_far = np.maximum.accumulate(tps_gpu[order])
    prev_best = np.concatenate(([-np.inf], best_so_far[:-1]))
    keep_sorted = tps_gpu[order] > prev_best
    mask = np.zeros(tps_user.size, dtype=bool)
    mask[order[keep_sorted]] = True
    return mask


def best_under_sla(tps_gpu: np.ndarray, ttft: np.ndarray, tpot: np.ndarray, feasible: np.ndarray,
                   ttft_limit_s: float | None, itl_limit_s: float | None) -> int | None:
    """Index of the highest-throughput feasible point meeting both latency limits, or None."""
    ok = feasible.copy()
    if ttft_limit_s is not None:
        ok &= ttft <= ttft_limit_s
    if itl_limit_s is not None:
        ok &= tpot <= itl_limit_s
    if not ok.any():
        return None
    return int(np.flatnonzero(ok)[np.argmax(tps_gpu[ok])])


DEFAULT_USD_PER_GPU_HOUR = 3.0  # the price a GPU-hour is given unless one is named (--usd-per-gpu-hour)


def usd_per_million_tokens(tps_gpu: float, usd_per_gpu_hour: float) -> float:
    """Cost of one million output tokens when every GPU-hour costs `usd_per_gpu_hour`."""
    if tps_gpu <= 0:
        raise ValueError("cost: field tps_gpu must be > 0")
    return usd_per_gpu_hour / (tps_gpu * 3600.0) * 1e6
