"""What the planner sees of a deployment over one interval, whoever measured it.

Demand is counted where it is admitted (requests that arrived), not where it completes: under
backpressure completions fall behind and would hide the load. A field nobody could measure is
None and named in `missing`, so the planner can hold and say so rather than plan on zeros.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SERVING, STARTING, DRAINING = "serving", "starting", "draining"


@dataclass(slots=True)
class Observation:
    at_s: float  # end of the interval (the deployment's clock: wall or simulated)
    interval_s: float
    requests: int | None = None  # admitted in the interval
    mean_isl: float | None = None  # prompt tokens per admitted request
    mean_osl: float | None = None  # output tokens per request (of those that finished)
    hit_fraction: float | None = None  # prompt tokens served from a prefix cache
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    itl_p50_s: float | None = None
    itl_p90_s: float | None = None
    queue_depth: int | None = None  # waiting for a replica or for KV
    queue_time_s: float | None = None  # mean wait before the first step
    waiting_for_worker: int | None = None  # held at the frontend now: the serving pool has no replica
    decode_kv_usage: float | None = None  # mean over serving decode (or agg) replicas, 0..1
    isl_cv2: float | None = None  # squared coefficient of variation of the prompt lengths (queueing headroom)
    peak_prompt_tokens_per_s: float | None = None  # the busiest second's admitted prompt tokens (bursts)
    streams_mean: float | None = None  # streams past their first token, not finished: the mean of each second's
    streams_p90: float | None = None  # ... and their 90th percentile (how far a decode pool's batches peak)
    replicas: dict[str, dict[str, int]] = field(default_factory=dict)  # role -> state -> count
    warm_replicas: dict[str, int] = field(default_factory=dict)  # role -> serving past their warm-up

    @property
    def missing(self) -> list[str]:
        """What the planner needs and nobody measured (an interval without arrivals needs no lengths)."""
        if self.requests is None:
            return ["requests"]
        return [name for name in ("mean_isl", "mean_osl") if self.requests and getattr(self, name) is None]

    def count(self, role: str, *states: str) -> int:
        by_state = self.replicas.get(role, {})
        return sum(by_state.get(s, 0) for s in (states or (SERVING, STARTING)))

    def to_json(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        return fields | {"missing": self.missing}


def squared_cv(count: float, total: float, total_squares: float) -> float | None:
    """Variance ÷ mean² of samples known by their count, sum and sum of squares (None for fewer
    than two samples or a zero mean)."""
    if count < 2 or total <= 0:
        return None
    mean = total / count
    return max(total_squares / count / (mean * mean) - 1.0, 0.0)
