"""Requests waiting for one of the fleet's slots (`--max-in-flight`), released by priority class,
then by each tenant's weighted share of tokens within the class.

    queue = FairQueue(max_in_flight=64)
    slot = await queue.acquire(tenant, cost=prompt_tokens + max_tokens, timeout_s=30)  # QueueTimeout
    ...                                             # the request runs
    queue.release(slot, used_tokens)                # its slot frees; its tenant pays what it used

- Class first: a waiting `interactive` request goes before any `standard` one, and those before
  any `batch` one.
- Within a class, start-time fair queueing over tokens: each tenant has a virtual time, advanced
  by cost / weight as its requests are admitted (and corrected to the tokens really used as they
  end); the waiting request whose tenant's virtual time is least goes first. Backlogged tenants
  are thus served tokens in proportion to their weights, whatever their request rates (deficit
  round robin's share, without its rounds). A tenant back from idle starts at the class's
  virtual time, the start of the last request admitted in it: no credit for the idle time.
- Requests of one tenant go in arrival order.

A request that waits past its timeout raises `QueueTimeout`; one cancelled while waiting (its
client gone) leaves the queue and holds no slot.
"""
from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field

from tokenmill.tenants.config import CLASSES, Tenant


class QueueTimeout(Exception):
    def __init__(self, waited_s: float) -> None:
        super().__init__(f"the fleet stayed saturated for the {waited_s:g} s this request may wait")
        self.waited_s = waited_s


@dataclass(slots=True)
class Slot:
    tenant: Tenant
    cost: int
    released: bool = False


@dataclass(slots=True)
class _Waiter:
    tenant: Tenant
    cost: int
    order: int
    granted: asyncio.Future[Slot] = field(repr=False)


class FairQueue:
    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"--max-in-flight must be at least 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.waiting: dict[str, deque[_Waiter]] = {}  # by tenant, in arrival order
        self.vtime: dict[str, float] = {}  # by tenant: tokens admitted / weight
        self.class_vtime = dict.fromkeys(CLASSES, 0.0)
        self._order = itertools.count()

    def waiting_for(self, tenant: str) -> int:
        return len(self.waiting.get(tenant, ()))

    async def acquire(self, tenant: Tenant, cost: int, timeout_s: float | None) -> Slot:
        if self.in_flight < self.max_in_flight and not any(self.waiting.values()):
            return self._admit(tenant, cost)
        waiter = _Waiter(tenant, cost, next(self._order), asyncio.get_running_loop().create_future())
        self.waiting.setdefault(tenant.name, deque()).append(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.granted), timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            self._leave(waiter)
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(timeout_s or 0.0) from None
            raise

    def release(self, slot: Slot, used_tokens: int) -> None:
        """Frees the slot (once) and charges its tenant the tokens it used instead of its estimate."""
        if slot.released:
            return
        slot.released = True
        self.in_flight -= 1
        name = slot.tenant.name
        self.vtime[name] = self.vtime.get(name, 0.0) + (used_tokens - slot.cost) / slot.tenant.weight
        self._dispatch()

    def _admit(self, tenant: Tenant, cost: int) -> Slot:
        start = self._start(tenant)  # (a backlogged tenant's own time is never behind its class's)
        self.class_vtime[tenant.priority_class] = start
        self.vtime[tenant.name] = start + cost / tenant.weight
        self.in_flight += 1
        return Slot(tenant, cost)

    def _dispatch(self) -> None:
        while self.in_flight < self.max_in_flight:
            heads = [queue[0] for queue in self.waiting.values() if queue]
            if not heads:
                return
            rank = CLASSES.index
            first = min(heads, key=lambda w: (rank(w.tenant.priority_class), self._start(w.tenant), w.order))
            self.waiting[first.tenant.name].popleft()
            first.granted.set_result(self._admit(first.tenant, first.cost))

    def _start(self, tenant: Tenant) -> float:
        return max(self.vtime.get(tenant.name, 0.0), self.class_vtime[tenant.priority_class])

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter gives up: out of the queue, or, granted meanwhile, its slot handed back."""
        if waiter.granted.done() and not waiter.granted.cancelled():
            slot = waiter.granted.result()
            self.release(slot, slot.cost)
            return
        waiter.granted.cancel()
        queue = self.waiting.get(waiter.tenant.name)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
