"""Synthetic load for the fleet simulator: seeded arrivals and lengths → `TraceRequest`s.

Poisson, gamma (a coefficient of variation for bursts) or a day-shaped rate (see `synthetic`).
No prefixes are shared: every request is all padding, so every chain is unique. The list is
built as a trace's is (`arrivals.build_requests`): sorted by arrival, ids `r0, r1, ...`.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE
from tokenmill.sim.fleet.arrivals import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    build_requests,
    check_positive_int,
)
from tokenmill.sim.fleet.trace_rows import Rows


def synthetic(
    kind: str = "poisson",
    *,
    rate: float,
    input_tokens: int,
    output_tokens: int,
    duration_s: float | None = None,
    num_requests: int | None = None,
    input_sigma: float = 0.0,
    output_sigma: float = 0.0,
    cv: float = 1.0,
    period_s: float = 86_400.0,
    peak_to_trough: float = 4.0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> list[TraceRequest]:
    """Seeded synthetic load; the same arguments always give the same list.

    Arrivals (give exactly one of `duration_s`, arrivals in [0, duration_s), or
    `num_requests`), at a mean of `rate` requests/s:
    - "poisson": exponential gaps.
    - "gamma": gamma gaps with coefficient of variation `cv` (1 = Poisson, > 1 bursty).
    - "day": a Poisson process of rate `rate * (1 - a cos(2π t / period_s))`, a =
      (R - 1) / (R + 1) for R = `peak_to_trough`: the trough at t = 0, the peak at period_s / 2,
      the mean `rate` over a period; drawn by thinning a Poisson process of the peak rate.
    Lengths: `input_tokens` / `output_tokens` exactly when their sigma is 0, else lognormal with
    that mean and log-space sigma, rounded, at least 1. Lengths come from their own random
    streams, so request i has the same lengths whatever the arrival kind or rate. No prefixes
    are shared: every request has its own chain.
    """
    _check_synthetic_args(kind, rate, input_tokens, output_tokens, duration_s, num_requests,
                          input_sigma, output_sigma, cv, period_s, peak_to_trough, block_size)
    times = _arrival_times(_process(kind, rate, cv, period_s, peak_to_trough),
                           np.random.default_rng([seed, 0]), duration_s, num_requests)
    n = len(times)
    rows = Rows.unshared(times,
                         _lengths(np.random.default_rng([seed, 1]), input_tokens, input_sigma, n),
                         _lengths(np.random.default_rng([seed, 2]), output_tokens, output_sigma, n))
    index = np.arange(n, dtype=np.int64)  # no hash ids, so tokens_per_hash_block is moot
    return build_requests(rows, index, np.zeros(n, dtype=np.int64), times, block_size,
                          MOONCAKE_BLOCK_TOKENS)


# ---------------------------------------------------------------------------------------------
# Argument checks


def _check_synthetic_args(kind: str, rate: float, input_tokens: int, output_tokens: int,
                          duration_s: float | None, num_requests: int | None,
                          input_sigma: float, output_sigma: float, cv: float, period_s: float,
                          peak_to_trough: float, block_size: int) -> None:
    """Every argument of `synthetic` in range, or ValueError naming it."""
    if kind not in ("poisson", "gamma", "day"):
        raise ValueError(f'kind must be "poisson", "gamma" or "day", got {kind!r}')
    for name, value in (("input_tokens", input_tokens), ("output_tokens", output_tokens),
                        ("block_size", block_size)):
        check_positive_int(name, value)
    if (duration_s is None) == (num_requests is None):
        raise ValueError("give exactly one of duration_s and num_requests")
    if num_requests is not None:
        check_positive_int("num_requests", num_requests)
    for name, value in (("rate", rate), ("cv", cv), ("period_s", period_s),
                        ("duration_s", 1.0 if duration_s is None else duration_s)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value}")
    for name, value in (("input_sigma", input_sigma), ("output_sigma", output_sigma)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if not (math.isfinite(peak_to_trough) and peak_to_trough >= 1):
        raise ValueError(f"peak_to_trough must be a finite number >= 1, got {peak_to_trough}")


# ---------------------------------------------------------------------------------------------
# Synthetic arrivals and lengths


# A process draws `count` arrival candidates after time t: (times, accepted mask, last candidate).
_Process = Callable[[np.random.Generator, float, int], tuple[np.ndarray, np.ndarray, float]]


def _process(kind: str, rate: float, cv: float, period_s: float, peak_to_trough: float) -> _Process:
    """The arrival process of `synthetic`'s `kind` (see its docstring)."""
    a = (peak_to_trough - 1.0) / (peak_to_trough + 1.0)
    peak = rate * (1.0 + a)

    def draw(rng: np.random.Generator, t: float, count: int) -> tuple[np.ndarray, np.ndarray, float]:
        if kind == "poisson":
            gaps = rng.exponential(1.0 / rate, count)
        elif kind == "gamma":
            gaps = rng.gamma(1.0 / cv**2, cv**2 / rate, count)
        else:
            gaps = rng.exponential(1.0 / peak, count)
        times = t + np.cumsum(gaps)
        if kind != "day":
            return times, np.ones(count, dtype=bool), float(times[-1])
        level = rate * (1.0 - a * np.cos(2.0 * np.pi * times / period_s))
        return times, rng.random(count) * peak < level, float(times[-1])
    return draw


def _arrival_times(draw: _Process, rng: np.random.Generator, duration_s: float | None,
                   num_requests: int | None) -> np.ndarray:
    """Arrivals until `duration_s` (exclusive) or the first `num_requests`, in chunks."""
    chunks, t, total = [], 0.0, 0
    while True:
        times, accepted, t = draw(rng, t, 4096)
        chunks.append(times[accepted])
        total += int(accepted.sum())
        if (num_requests is not None and total >= num_requests) or (
                duration_s is not None and t >= duration_s):
            break
    times = np.concatenate(chunks)
    return times[:num_requests] if num_requests is not None else times[times < duration_s]


def _lengths(rng: np.random.Generator, mean: int, sigma: float, n: int) -> np.ndarray:
    """`mean` exactly (sigma 0), or lognormal with that mean and log-space sigma, >= 1."""
    if sigma == 0:
        return np.full(n, mean, dtype=np.int64)
    draws = rng.lognormal(math.log(mean) - sigma**2 / 2.0, sigma, n)
    return np.maximum(1, np.rint(draws)).astype(np.int64)
