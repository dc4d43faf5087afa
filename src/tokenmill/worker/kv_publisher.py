"""Publishes the engine's KV events to routers: on a ZeroMQ PUB socket (the embedded default),
or on the worker's NATS subject (`--event-plane`, `runtime/event_plane.py`).

The engine emits events on its own thread; they are queued and sent from the
asyncio loop in batches (one frame per loop turn), because a ZeroMQ socket must
only be used from one thread. A router that joins late, or drops frames, sees a
gap in `event_id` and asks for a snapshot (`snapshot()`, taken on the engine
thread so blocks and event ids agree).
"""
from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from tokenmill.engines.adapter import EngineAdapter
from tokenmill.kv.events import KVEvent, event_to_wire
from tokenmill.runtime import protocol as p

if TYPE_CHECKING:
    from tokenmill.runtime.event_plane import NatsEventPlane


class KVEventPublisher:
    def __init__(self, engine: EngineAdapter, worker_id: str, address: str | None = None,
                 plane: NatsEventPlane | None = None, subject: str | None = None) -> None:
        """Exactly one of `address` (ZeroMQ PUB, bound here) and `plane` + `subject` (NATS)."""
        if (address is None) == (plane is None or subject is None):
            raise ValueError("KV events go on one plane: a ZeroMQ address or a NATS subject")
        self.engine = engine
        self.worker_id = worker_id
        self.plane, self.subject = plane, subject
        self.socket: zmq.asyncio.Socket | None = None
        self.address: str | None = None
        if address is not None:
            self.socket = zmq.asyncio.Context.instance().socket(zmq.PUB)
            self.socket.setsockopt(zmq.LINGER, 0)
            self.address = _bind(self.socket, address)
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # the engine thread appends, the loop thread takes
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.events.subscribe(self._on_event)

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()

    def _on_event(self, event: KVEvent) -> None:  # engine thread
        if self._loop is None:
            return
        wire = event_to_wire(event)
        with self._lock:
            first = not self._pending
            self._pending.append(wire)
        if first:
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:  # event loop thread
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            frame = p.pack({"type": p.KV_EVENTS, "worker": self.worker_id, "events": batch})
            if self.plane is not None and self.subject is not None:
                self.plane.publish(self.subject, frame)
                return
            try:
                self.socket.send(frame, flags=zmq.NOBLOCK)  # type: ignore[union-attr]
            except zmq.ZMQError:
                pass  # subscribers will see the gap and ask for a snapshot

    async def snapshot(self) -> dict[str, Any]:
        """Every hash the worker holds, per tier, with the id of the last event it reflects."""
        last_event_id, tiers = await self.engine.kv_snapshot()
        return {"type": p.KV_SNAPSHOT, "worker": self.worker_id, "last_event_id": last_event_id, "tiers": tiers}


def _bind(socket: zmq.Socket, address: str) -> str:
    if address.endswith(":0"):
        base = address.rsplit(":", 1)[0]
        return f"{base}:{socket.bind_to_random_port(base)}"
    socket.bind(address)
    return address
