"""KV events: what a worker tells routers about the blocks it holds (ARCHITECTURE.md, "KV events and snapshots").

`stored{worker, tier, parent, hashes[], event_id}`, `removed{worker, tier, hashes[],
event_id}`, `cleared{worker, event_id}`. `event_id` increases by one per worker,
across all of that worker's tiers, so a consumer can detect a gap.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TIERS: tuple[str, ...] = ("device", "host", "disk", "shared")


@dataclass(slots=True, frozen=True)
class BlockStored:
    worker: str
    tier: str
    parent: int | None
    hashes: tuple[int, ...]
    event_id: int
    kind: str = field(default="stored", init=False)


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    worker: str
    tier: str
    hashes: tuple[int, ...]
    event_id: int
    kind: str = field(default="removed", init=False)


@dataclass(slots=True, frozen=True)
class AllCleared:
    worker: str
    event_id: int
    kind: str = field(default="cleared", init=False)


KVEvent = BlockStored | BlockRemoved | AllCleared
KVEventSubscriber = Callable[[KVEvent], None]


def event_to_wire(event: KVEvent) -> dict[str, Any]:
    """A msgpack-ready dict (plain types only)."""
    out: dict[str, Any] = {"kind": event.kind, "worker": event.worker, "event_id": event.event_id}
    if isinstance(event, (BlockStored, BlockRemoved)):
        out["tier"] = event.tier
        out["hashes"] = list(event.hashes)
    if isinstance(event, BlockStored):
        out["parent"] = event.parent
    return out


def event_from_wire(msg: dict[str, Any]) -> KVEvent:
    """Inverse of `event_to_wire`; raises ValueError on a malformed message."""
    try:
        kind = msg["kind"]
        worker, event_id = str(msg["worker"]), int(msg["event_id"])
        if kind == "stored":
            return BlockStored(worker, _tier(msg["tier"]), msg.get("parent"),
                               tuple(int(h) for h in msg["hashes"]), event_id)
        if kind == "removed":
            return BlockRemoved(worker, _tier(msg["tier"]), tuple(int(h) for h in msg["hashes"]), event_id)
        if kind == "cleared":
            return AllCleared(worker, event_id)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed KV event: {msg!r}") from exc
    raise ValueError(f"unknown KV event kind: {kind!r}")


def _tier(tier: Any) -> str:
    if tier not in TIERS:
        raise ValueError(f"unknown KV tier {tier!r}; expected one of {TIERS}")
    return str(tier)


class KVEventEmitter:
    """Numbers a worker's events and hands them to subscribers, in order.

    One emitter per worker, shared by all its tiers; thread-safe because tiers
    may offload from a background thread.
    """

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self._next_id = 0
        self._subscribers: list[KVEventSubscriber] = []
        self._lock = threading.Lock()

    def subscribe(self, subscriber: KVEventSubscriber) -> None:
        self._subscribers.append(subscriber)

    @property
    def last_event_id(self) -> int:
        """Id of the last event emitted (-1 before the first)."""
        return self._next_id - 1

    def stored(self, tier: str, parent: int | None, hashes: list[int]) -> None:
        if hashes:
            self._emit(lambda eid: BlockStored(self.worker, tier, parent, tuple(hashes), eid))

    def removed(self, tier: str, hashes: list[int]) -> None:
        if hashes:
            self._emit(lambda eid: BlockRemoved(self.worker, tier, tuple(hashes), eid))

    def cleared(self) -> None:
        self._emit(lambda eid: AllCleared(self.worker, eid))

    def _emit(self, make: Callable[[int], KVEvent]) -> None:
        with self._lock:
            event = make(self._next_id)
            self._next_id += 1
            for subscriber in self._subscribers:
                subscriber(event)
