"""A tenant's quotas, checked as each request arrives (the frontend answers a refusal with 429 and
`Retry-After`):

    gate = QuotaGate("sweeps", Quotas(requests_per_s=20, tokens_per_min=60_000, max_concurrent=4))
    refusal = gate.admit()      # None (admitted: the request holds a slot), or a Refusal naming the quota
    gate.charge(tokens)         # prompt + output tokens of a finished stream (tokens_per_min)
    gate.release()              # the request is over: its slot is free again

- `requests_per_s` R: a token bucket of R tokens a second holding at most max(R, 1), one per request;
- `tokens_per_min` T: a bucket refilled at T/60 tokens a second, holding at most T. A request is
  admitted while the bucket is not in debt, and its tokens are taken as it finishes (its output
  is not known before), so one request may take it into debt and the next wait until it is paid;
- `max_concurrent` C: at most C requests in flight.

A refusal takes nothing: it neither uses a request token nor counts against the others.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.tenants.config import Quotas


@dataclass(slots=True, frozen=True)
class Refusal:
    quota: str  # the field of the tenants file that refused the request
    retry_after_s: float
    message: str


class TokenBucket:
    def __init__(self, per_s: float, capacity: float, now: float) -> None:
        self.per_s, self.capacity = per_s, capacity
        self.level, self.at = capacity, now

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.at) * self.per_s)
        self.at = now
        return self.level

    def wait_for(self, level: float) -> float:
        """Seconds until the bucket holds `level` (0 when it does)."""
        return max(0.0, (level - self.level) / self.per_s)


class QuotaGate:
    def __init__(self, tenant: str, quotas: Quotas, clock: Callable[[], float] = time.monotonic) -> None:
        self.tenant, self.quotas, self.clock = tenant, quotas, clock
        now = clock()
        r, t = quotas.requests_per_s, quotas.tokens_per_min
        self.requests = None if r is None else TokenBucket(r, max(r, 1.0), now)
        self.tokens = None if t is None else TokenBucket(t / 60.0, float(t), now)
        self.in_flight = 0

    def admit(self) -> Refusal | None:
        now = self.clock()
        limit = self.quotas.max_concurrent
        if limit is not None and self.in_flight >= limit:
            return self._refusal("max_concurrent", limit, 1.0, f"{self.in_flight} requests in flight")
        if self.tokens is not None and self.tokens.refill(now) < 0:
            return self._refusal("tokens_per_min", self.quotas.tokens_per_min, self.tokens.wait_for(0.0),
                                 f"{-self.tokens.level:.0f} tokens over")
        if self.requests is not None and self.requests.refill(now) < 1.0:
            return self._refusal("requests_per_s", self.quotas.requests_per_s, self.requests.wait_for(1.0),
                                 "no request left this second")
        if self.requests is not None:
            self.requests.level -= 1.0
        self.in_flight += 1
        return None

    def charge(self, tokens: int) -> None:
        if self.tokens is not None:
            self.tokens.refill(self.clock())
            self.tokens.level -= tokens

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def _refusal(self, quota: str, limit: float | None, wait_s: float, state: str) -> Refusal:
        return Refusal(quota, wait_s, f"tenant {self.tenant!r} is over its {quota} quota ({limit:g}: {state}); "
                                      f"retry after {wait_s:.1f} s")
