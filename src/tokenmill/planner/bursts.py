"""The next interval's busiest second, forecast as a distribution: what a prefill pool must clear.

    bursts = BurstForecast(window=40)
    bursts.observe(peak)            # each interval's busiest second (prompt tokens), 0 when quiet
    bursts.quantile(0.9)            # covers the next interval's busiest second 90% of the time

A bursty load is not served by its mean: the prefill pool must clear the coming interval's
busiest second within the TTFT target, and that second is not known in advance. The last
`window` intervals' busiest seconds x₁ … xₙ are taken as draws of the next one (quiet intervals
count, as 0), and the forecast at level q is their k-th smallest,

    k = ⌈q (n + 1)⌉,

the split-conformal rank: when the draws are exchangeable, the next one is at most x₍ₖ₎ with
probability k / (n + 1) ≥ q, whatever their distribution. Until n is large enough for that rank
(k > n), the largest draw stands in. A planner that sizes for the quantile whose misses the SLA
target allows, rather than for the largest recent burst, does not pay all the time for the one
burst in ten it would rather let wait.
"""
from __future__ import annotations

import math
from collections import deque

from tokenmill.planner.flags import check_quantile


class BurstForecast:
    def __init__(self, window: int = 40) -> None:
        if window < 1:
            raise ValueError(f"a burst window must hold at least one interval, got {window}")
        self.draws: deque[float] = deque(maxlen=window)

    def observe(self, peak: float) -> None:
        self.draws.append(max(float(peak), 0.0))

    def quantile(self, q: float | None) -> float:
        """The forecast at level `q` (0 before any draw); None: the largest draw in the window."""
        check_quantile(q, "--burst-quantile")
        if not self.draws:
            return 0.0
        ordered = sorted(self.draws)
        if q is None:
            return ordered[-1]
        rank = math.ceil(q * (len(ordered) + 1))
        return ordered[min(rank, len(ordered)) - 1]
