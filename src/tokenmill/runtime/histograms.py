"""Prometheus histogram arithmetic over two scrapes, as `histogram_quantile(rate(...))` does it:
shared by the planner's live observer and the dashboard, which both read `/metrics`."""
from __future__ import annotations

import math
from collections.abc import Mapping


def quantile_between(q: float, before: Mapping[float, float], after: Mapping[float, float]) -> float | None:
    """The q-quantile of what a histogram observed between two scrapes of its cumulative buckets
    (upper bound -> count, +Inf included); None when it observed nothing (or was reset)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0 or any(c < 0 for c in counts):
        return None
    return histogram_quantile(q, bounds, counts)


def histogram_quantile(q: float, bounds: list[float], cumulative: list[float]) -> float:
    """Prometheus' histogram_quantile over cumulative bucket counts (the last bound is +Inf):
    linear within the bucket that holds the rank; the highest finite bound past it."""
    rank = q * cumulative[-1]
    for i, (bound, count) in enumerate(zip(bounds, cumulative)):
        if count >= rank:
            if math.isinf(bound):
                return bounds[i - 1] if i else 0.0
            low, below = (bounds[i - 1], cumulative[i - 1]) if i else (0.0, 0.0)
            in_bucket = count - below
            return low + (bound - low) * ((rank - below) / in_bucket if in_bucket else 1.0)
    return bounds[-2] if len(bounds) > 1 else 0.0
