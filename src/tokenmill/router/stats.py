"""Router metrics, and the "KV events stale" alarm.

`RouterStats.metrics_snapshot()` returns Prometheus series name -> value, in the shape
`Backend.metrics_snapshot()` uses (`name{label="v"}` keys, all `tokenmill_router_*`).
Histograms are flattened Prometheus-style: cumulative `_bucket{le=...}`, `_sum`, `_count`.

Events stale: in KV mode, when `stale_after_s` have passed since the last KV event (or
since start) while at least `min_decisions` decisions were made meanwhile, routing has
silently become load-only (workers publish nothing, or the subscription broke). The flag
is exposed as `tokenmill_router_kv_events_stale` and a warning is logged when it rises.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DECISION_LATENCY_BUCKETS_S: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3)
OVERLAP_BLOCKS_BUCKETS: tuple[float, ...] = (0, 1, 4, 16, 64, 256, 1024, 4096)


@dataclass(slots=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(self.bounds):
            raise ValueError(f"histogram bounds must be ascending, got {self.bounds}")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        index = 0
        for bound in self.bounds:
            if value <= bound:
                break
            index += 1
        self.counts[index] += 1
        self.total += value
        self.count += 1

    def series(self, name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            running += count
            out[f'{name}_bucket{{le="{"+Inf" if bound == float("inf") else f"{bound:g}"}"}}'] = running
        out[f"{name}_sum"] = self.total
        out[f"{name}_count"] = self.count
        return out


class RouterStats:
    def __init__(self, events_counter: Callable[[], int] | None, stale_after_s: float = 30.0,
                 min_decisions: int = 10, clock: Callable[[], float] = time.monotonic) -> None:
        """`events_counter`: KV events applied so far (None when no events are expected);
        read at decisions and checks rather than called per event, to keep events cheap."""
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be positive, got {stale_after_s}")
        self.events_counter = events_counter
        self.stale_after_s = stale_after_s
        self.min_decisions = min_decisions
        self.clock = clock
        self.decision_latency = Histogram(DECISION_LATENCY_BUCKETS_S)
        self.overlap_blocks = Histogram(OVERLAP_BLOCKS_BUCKETS)
        self.decisions_by_policy: dict[str, int] = {}
        self._last_event_at = clock()
        self._events_seen = 0
        self._decisions_since_event = 0
        self._stale = False

    def observe_decision(self, policy: str, latency_s: float, overlap_blocks: int) -> None:
        self.decision_latency.observe(latency_s)
        self.overlap_blocks.observe(overlap_blocks)
        self.decisions_by_policy[policy] = self.decisions_by_policy.get(policy, 0) + 1
        self._note_events()
        self._decisions_since_event += 1

    def events_stale(self) -> bool:
        """Re-evaluate (cheap) and return the stale flag; logs a warning when it rises."""
        if self.events_counter is None:
            return False
        self._note_events()
        silent_for = self.clock() - self._last_event_at
        stale = silent_for >= self.stale_after_s and self._decisions_since_event >= self.min_decisions
        if stale and not self._stale:
            log.warning("no KV events for %.0f s across %d routing decisions: routing on the router's own "
                        "past decisions (kv-approx) until they return (do the workers publish events? is the "
                        "event plane up?)", silent_for, self._decisions_since_event)
        elif self._stale and not stale:
            log.info("KV events are arriving again; routing on the event-built index resumed")
        self._stale = stale
        return stale

    def _note_events(self) -> None:
        if self.events_counter is None:
            return
        seen = self.events_counter()
        if seen != self._events_seen:
            self._events_seen, self._last_event_at, self._decisions_since_event = seen, self.clock(), 0

    def metrics_snapshot(self, index_blocks: int, events_applied: int, gaps_detected: int,
                         gaps_recovered: int, workers: Sequence[str]) -> dict[str, float]:
        out: dict[str, float] = {
            "tokenmill_router_index_blocks": index_blocks,
            "tokenmill_router_kv_events_applied_total": events_applied,
            "tokenmill_router_kv_event_gaps_total": gaps_detected,
            "tokenmill_router_kv_event_gaps_recovered_total": gaps_recovered,
            "tokenmill_router_kv_events_stale": float(self.events_stale()),
            "tokenmill_router_workers": len(workers),
        }
        for policy, count in self.decisions_by_policy.items():
            out[f'tokenmill_router_decisions_total{{policy="{policy}"}}'] = count
        out.update(self.decision_latency.series("tokenmill_router_decision_latency_seconds"))
        out.update(self.overlap_blocks.series("tokenmill_router_overlap_blocks"))
        return out
