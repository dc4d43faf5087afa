"""What a fleet simulation records: per request, per interval, per fleet change."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    worker: str = ""  # the replica that decodes it (or the aggregated one)
    prefill_worker: str = ""  # the prefill replica, when prefilled remotely
    prefill: str = ""  # "remote" or "local" (disaggregated), "" (aggregated)
    prefill_reason: str = ""
    cached_tokens: int = 0  # prompt tokens its prefill found in the prefix cache
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens: int = 0
    itl_max_s: float = 0.0
    preemptions: int = 0
    rejected: str = ""  # why it was never served ("" when it was)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.last_token_s is None else self.last_token_s - self.arrival_s

    @property
    def itl_mean_s(self) -> float | None:
        if self.tokens < 2 or self.first_token_s is None or self.last_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.tokens - 1)

    @property
    def finished(self) -> bool:
        return self.tokens >= self.output_tokens and not self.rejected

    def token_at(self, t: float) -> None:
        """One more token at `t` (keeps the first/last times and the largest gap)."""
        if self.first_token_s is None:
            self.first_token_s = t
        elif self.last_token_s is not None:
            self.itl_max_s = max(self.itl_max_s, t - self.last_token_s)
        self.last_token_s = t
        self.tokens += 1

    def tokens_in_run(self, t_first: float, t_last: float, count: int, longest_step_s: float) -> None:
        """`count` tokens, one per step of a decode run: the first at `t_first`, the last at `t_last`."""
        self.token_at(t_first)
        if count > 1:
            self.itl_max_s = max(self.itl_max_s, longest_step_s)
            self.last_token_s = t_last
            self.tokens += count - 1

    def to_json(self) -> dict[str, object]:
        return {"request_id": self.request_id, "arrival_s": self.arrival_s, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "worker": self.worker, "prefill_worker": self.prefill_worker,
                "prefill": self.prefill, "cached_tokens": self.cached_tokens, "ttft_s": self.ttft_s,
                "itl_mean_s": self.itl_mean_s, "itl_max_s": self.itl_max_s if self.tokens > 1 else None,
                "e2e_s": self.e2e_s, "preemptions": self.preemptions, "rejected": self.rejected or None}


@dataclass(slots=True)
class IntervalRecord:
    start_s: float
    arrivals: int
    queue_depth: int  # requests waiting for admission on any replica (or for a replica), at the end
    running: int
    kv_usage: float  # mean over serving replicas, at the end
    gpus: int  # provisioned (starting, serving or draining), at the end
    replicas: dict[str, int]  # serving replicas per role, at the end

    def to_json(self) -> dict[str, object]:
        return {"start_s": self.start_s, "arrivals": self.arrivals, "queue_depth": self.queue_depth,
                "running": self.running, "kv_usage": self.kv_usage, "gpus": self.gpus, "replicas": self.replicas}


@dataclass(slots=True, frozen=True)
class ChangeRecord:
    at_s: float
    action: str
    role: str
    count: int
    applied: int
    reason: str

    def to_json(self) -> dict[str, object]:
        return {"at_s": self.at_s, "action": self.action, "role": self.role, "count": self.count,
                "applied": self.applied, "reason": self.reason}
