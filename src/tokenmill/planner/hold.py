"""Size a pool for the level its recent load needed, not for each interval's swing.

    hold = LevelHold(quantile=0.8, window=20)     # 20 intervals: ten start-ups of 60 s at 30 s
    held, reasons = hold.apply({"agg": 12})       # records 12; each pool's quantile of its window

A replica asked for now serves one start-up later. On a load whose bursts last less than that
(the Azure code trace: a minute of 2,000 requests after two silent ones), a planner that follows
each interval adds replicas when the burst is already over and removes them in the lull before
the next one: it pays more than a fixed fleet and still misses the bursts. Each pool is instead
sized for the level the last `window` proposals asked for, their empirical quantile

    held = x₍ₖ₎,  k = ⌈quantile · n⌉     (x₍₁₎ ≤ … ≤ x₍ₙ₎ the last n ≤ window proposals)

so a swing that lasts less than (1 − quantile) of the window moves nothing, and a level that lasts
longer moves the pool there: a rise after n − k + 1 intervals, a fall after k. On a
smooth load the proposals barely differ and the held level is the proposal. The price is a
lasting step up, which waits n − k + 1 intervals on this path; with `--fast-path-s` a pool whose
first tokens are late grows at once between intervals (the fast path is not held).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

from tokenmill.planner.flags import check_quantile


class LevelHold:
    def __init__(self, quantile: float, window: int) -> None:
        check_quantile(quantile, "--hold-quantile")
        if window < 1:
            raise ValueError(f"--hold-window-s must span at least one planner interval, got {window} intervals")
        self.quantile = quantile
        self.window = window
        self.proposals: dict[str, deque[int]] = {}

    def apply(self, proposed: Mapping[str, int]) -> tuple[dict[str, int], list[str]]:
        """Record `proposed` and return each pool's held level, with a line for each pool it changed."""
        held, reasons = {}, []
        for role, n in proposed.items():
            recent = self.proposals.setdefault(role, deque(maxlen=self.window))
            recent.append(n)
            ordered = sorted(recent)
            held[role] = ordered[max(math.ceil(self.quantile * len(ordered) - 1e-9), 1) - 1]
            if held[role] != n:
                reasons.append(f"{role}: {held[role]}, the {self.quantile:.0%} quantile of the last {len(ordered)} "
                               f"intervals' proposals ({ordered[0]}-{ordered[-1]}), not this one's {n}: a swing "
                               "shorter than that is over before replicas started for it serve")
        return held, reasons
