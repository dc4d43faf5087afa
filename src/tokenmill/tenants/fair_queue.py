"""Requests waiting for one of the fleet's slots (`--max-in-flight`), released by priority class,
then by each tenant's weighted share of tokens within the class.

    queue = FairQueue(max_in_flight=64)
    slot = await queue.acquire(tenant, timeout_s=30)   # QueueTimeout past the wait allowed
    queue.charge(slot, tokens)                         # each of its streams' tokens, as it ends
    queue.release(slot)                                # the request is over: its slot frees

    share = FairShare(max_in_flight=64)                # the same order, without the waiting
    share.enqueue(tenant, item)                        # (the fleet simulator's frontend)
    for item, slot in share.grant(): ...               # the items let in now, in order

- Class first: a waiting `interactive` request goes before any `standard` one, and those before
  any `batch` one; and `batch` requests hold at most `batch_share` of the slots, so the others'
  arrivals find room without waiting for a batch request to end (in the engine they then take a
  batch sequence's place: `step_policy`).
- Within a class, start-time fair queueing over tokens: each tenant has a virtual time, advanced
  by tokens / weight. A request admitted advances it by the tenant's usual tokens per request
  (a moving average of its past requests'), which its streams' real tokens replace as they end;
  the waiting request whose tenant's virtual time is least goes first. Backlogged tenants are
  thus served tokens in proportion to their weights, whatever their request rates (deficit
  round robin's share, without its rounds). A tenant back from idle starts at the class's
  virtual time, the start of the last request admitted in it: no credit for the idle time.
- Requests of one tenant go in arrival order.

A request that waits past its timeout raises `QueueTimeout`; one cancelled while waiting (its
client gone) leaves the queue and holds no slot.
"""
from __future__ import annotations

import asyncio
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tokenmill.tenants.config import CLASSES, Tenant

COST_SMOOTHING = 0.2  # the weight of a tenant's latest request in its usual tokens per request


class QueueTimeout(Exception):
    def __init__(self, waited_s: float) -> None:
        super().__init__(f"the fleet stayed saturated for the {waited_s:g} s this request may wait")
        self.waited_s = waited_s


@dataclass(slots=True)
class Slot:
    tenant: Tenant
    estimate: float  # tokens its tenant was charged when it was admitted
    used: int = 0  # tokens its streams charged since
    released: bool = False


class FairShare:
    """The order of release, with no waiting in it: `enqueue` items, `grant` the slots free now."""

    def __init__(self, max_in_flight: int, batch_share: float = 0.8) -> None:
        if max_in_flight < 1:
            raise ValueError(f"--max-in-flight must be at least 1, got {max_in_flight}")
        if not 0.0 < batch_share <= 1.0:
            raise ValueError(f"--batch-share must be in (0, 1], got {batch_share}")
        self.max_in_flight = max_in_flight
        self.batch_slots = max(1, math.floor(max_in_flight * batch_share))
        self.in_flight = 0
        self.batch_in_flight = 0
        self.waiting: dict[str, deque[_Waiting]] = {}  # by tenant, in arrival order
        self.vtime: dict[str, float] = {}  # by tenant: tokens / weight
        self.usual_cost: dict[str, float] = {}  # by tenant: a moving average of tokens per request
        self.class_vtime = dict.fromkeys(CLASSES, 0.0)
        self._order = itertools.count()

    def waiting_for(self, tenant: str) -> int:
        return len(self.waiting.get(tenant, ()))

    def enqueue(self, tenant: Tenant, item: Any) -> None:
        self.waiting.setdefault(tenant.name, deque()).append(_Waiting(tenant, next(self._order), item))

    def withdraw(self, tenant: Tenant, item: Any) -> bool:
        """`item` leaves the queue without a slot; False if it was not waiting."""
        queue = self.waiting.get(tenant.name, deque())
        for waiting in queue:
            if waiting.item is item:
                queue.remove(waiting)
                return True
        return False

    def grant(self) -> list[tuple[Any, Slot]]:
        """The waiting items let in now, each with its slot, in the order they go."""
        granted = []
        while self.in_flight < self.max_in_flight:
            batch_room = self.batch_in_flight < self.batch_slots
            heads = [queue[0] for queue in self.waiting.values()
                     if queue and (batch_room or queue[0].tenant.priority_class != "batch")]
            if not heads:
                break
            rank = CLASSES.index
            first = min(heads, key=lambda w: (rank(w.tenant.priority_class), self._start(w.tenant), w.order))
            self.waiting[first.tenant.name].popleft()
            granted.append((first.item, self._admit(first.tenant)))
        return granted

    def charge(self, slot: Slot, tokens: int) -> None:
        slot.used += tokens
        self.vtime[slot.tenant.name] = self.vtime.get(slot.tenant.name, 0.0) + tokens / slot.tenant.weight

    def release(self, slot: Slot) -> None:
        """Frees the slot (once): its tenant's estimate gives way to what its streams charged."""
        if slot.released:
            return
        slot.released = True
        self.in_flight -= 1
        self.batch_in_flight -= slot.tenant.priority_class == "batch"
        name = slot.tenant.name
        self.vtime[name] = self.vtime.get(name, 0.0) - slot.estimate / slot.tenant.weight
        usual = self.usual_cost.get(name)
        if slot.used:  # (a request that ended before any stream did says nothing of its tenant's usual)
            self.usual_cost[name] = slot.used if usual is None else usual + COST_SMOOTHING * (slot.used - usual)

    def _admit(self, tenant: Tenant) -> Slot:
        start = self._start(tenant)  # (a backlogged tenant's own time is never behind its class's)
        estimate = self.usual_cost.get(tenant.name, 0.0)
        self.class_vtime[tenant.priority_class] = start
        self.vtime[tenant.name] = start + estimate / tenant.weight
        self.in_flight += 1
        self.batch_in_flight += tenant.priority_class == "batch"
        return Slot(tenant, estimate)

    def _start(self, tenant: Tenant) -> float:
        return max(self.vtime.get(tenant.name, 0.0), self.class_vtime[tenant.priority_class])


@dataclass(slots=True)
class _Waiting:
    tenant: Tenant
    order: int
    item: Any = field(repr=False)


class FairQueue:
    """`FairShare` with asyncio waiting: `acquire` returns once its request is let in."""

    def __init__(self, max_in_flight: int, batch_share: float = 0.8) -> None:
        self.share = FairShare(max_in_flight, batch_share)

    def waiting_for(self, tenant: str) -> int:
        return self.share.waiting_for(tenant)

    async def acquire(self, tenant: Tenant, timeout_s: float | None) -> Slot:
        granted: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self.share.enqueue(tenant, granted)
        self._dispatch()
        try:
            async with asyncio.timeout(timeout_s):
                return await granted
        except BaseException as exc:  # timed out or cancelled: out of the queue, or the slot handed back
            self._leave(tenant, granted)
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(timeout_s or 0.0) from None
            raise

    def charge(self, slot: Slot, tokens: int) -> None:
        self.share.charge(slot, tokens)

    def release(self, slot: Slot) -> None:
        self.share.release(slot)
        self._dispatch()

    def _dispatch(self) -> None:
        given_back = True
        while given_back:
            given_back = False
            for granted, slot in self.share.grant():
                if granted.done():  # its waiter gave up (cancelled) and has not yet left the queue
                    self.share.release(slot)
                    given_back = True
                else:
                    granted.set_result(slot)

    def _leave(self, tenant: Tenant, granted: asyncio.Future[Slot]) -> None:
        if granted.done() and not granted.cancelled():
            self.release(granted.result())  # granted as it gave up: nothing used
            return
        granted.cancel()
        self.share.withdraw(tenant, granted)  # (already out if a release gave its slot back meanwhile)
