"""Conditional disaggregation: whether a request's prompt is prefilled on a prefill worker.

A deployment with prefill workers sends each new request's prompt to one of them unless
prefilling it where it will be decoded is cheaper (ARCHITECTURE.md, "The disaggregated path"):

- `short_uncached_prompt`: the part of the prompt the chosen decode worker does not already
  cache is below `threshold_tokens` — moving its KV would cost more than computing it;
- `prefill_queue_full`: every prefill worker already has `queue_limit` prefills in flight from
  this frontend, so waiting there would cost more TTFT than prefilling locally — but only while
  the decode worker prefills fewer than `local_limit` prompts of its own. Each local prefill
  stalls every stream the decode worker holds for its chunks, so under a sustained overload an
  unbounded fallback turns the prefill pool's TTFT misses into ITL misses for requests that
  were fine (measured on the Azure code trace: 15% of all requests). Past the limit the prompt
  waits in the shortest prefill queue instead (`decode_worker_busy`);
- `no_prefill_worker`: none is registered (or all were tried and failed: `prefill_failed`).

Every decision is counted by (decision, reason) and exported as
`tokenmill_disagg_decisions_total{decision, reason}`.

It lives with the router, not the frontend, so the fleet simulator (`sim.fleet`) decides with
the very rule the live frontend uses.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

REMOTE, LOCAL = "remote", "local"


@dataclass(slots=True, frozen=True)
class DisaggConfig:
    threshold_tokens: int = 256  # uncached prompt tokens from which prefill goes remote
    queue_limit: int = 8  # prefills in flight per prefill worker before prefilling locally
    local_limit: int = 1  # ... and local prefills in flight on the decode worker while it does (0: never)
    max_prefill_attempts: int = 2  # prefill workers tried before falling back to local prefill

    def __post_init__(self) -> None:
        if self.threshold_tokens < 0:
            raise ValueError(f"--disagg-threshold must be >= 0, got {self.threshold_tokens}")
        if self.queue_limit < 1:
            raise ValueError(f"--prefill-queue-limit must be >= 1, got {self.queue_limit}")
        if self.local_limit < 0:
            raise ValueError(f"--local-prefill-limit must be >= 0, got {self.local_limit}")
        if self.max_prefill_attempts < 1:
            raise ValueError(f"max_prefill_attempts must be >= 1, got {self.max_prefill_attempts}")


@dataclass(slots=True, frozen=True)
class PrefillDecision:
    decision: str  # REMOTE or LOCAL
    reason: str
    uncached_tokens: int


class DisaggPolicy:
    def __init__(self, config: DisaggConfig) -> None:
        self.config = config
        self.counts: Counter[tuple[str, str]] = Counter()

    def decide(self, prompt_tokens: int, cached_tokens: int, prefill_in_flight: Iterable[int],
               local_in_flight: int = 0) -> PrefillDecision:
        """Where to prefill, given the decode worker's cached prefix, the prefill workers' queues and
        the prompts the decode worker is prefilling itself (not yet at their first token)."""
        uncached = max(0, prompt_tokens - cached_tokens)
        queues = list(prefill_in_flight)
        if not queues:
            choice = PrefillDecision(LOCAL, "no_prefill_worker", uncached)
        elif uncached < self.config.threshold_tokens:
            choice = PrefillDecision(LOCAL, "short_uncached_prompt", uncached)
        elif min(queues) >= self.config.queue_limit and local_in_flight < self.config.local_limit:
            choice = PrefillDecision(LOCAL, "prefill_queue_full", uncached)
        elif min(queues) >= self.config.queue_limit:
            choice = PrefillDecision(REMOTE, "decode_worker_busy", uncached)
        else:
            choice = PrefillDecision(REMOTE, "long_uncached_prompt", uncached)
        self.counts[(choice.decision, choice.reason)] += 1
        return choice

    def fell_back(self) -> None:
        """A remote prefill failed on every worker tried; the decode worker prefills."""
        self.counts[(LOCAL, "prefill_failed")] += 1

    def metrics_snapshot(self) -> dict[str, float]:
        return {f'tokenmill_disagg_decisions_total{{decision="{d}",reason="{r}"}}': float(n)
                for (d, r), n in self.counts.items()}
