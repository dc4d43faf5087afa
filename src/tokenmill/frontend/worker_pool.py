"""The frontend's view of the workers: one DEALER connection each, kept in step with
discovery, with liveness from heartbeats.

A worker is dropped when discovery stops listing it or when nothing (heartbeat or
tokens) has arrived from it for `heartbeat_timeout_s`; every stream still open on
it then receives a `LOST` marker, so the request can be migrated.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import zmq
import zmq.asyncio

from tokenmill.runtime import protocol as p
from tokenmill.runtime.discovery import Discovery, WorkerInfo

log = logging.getLogger(__name__)

LOST: dict[str, Any] = {"type": "worker_lost"}


class WorkerConnection:
    def __init__(self, info: WorkerInfo, ctx: zmq.asyncio.Context) -> None:
        self.info = info
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(info.address)
        self.streams: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self.last_seen = time.monotonic()
        self.load: dict[str, float] = dict(info.metadata)
        self._reader = asyncio.create_task(self._read())
        self.send({"type": p.HELLO})

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def send(self, message: dict[str, Any]) -> None:
        self.socket.send(p.pack(message), flags=zmq.NOBLOCK)

    def open_stream(self, request_id: str) -> asyncio.Queue[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.streams[request_id] = queue
        return queue

    def close_stream(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def close(self) -> None:
        self._reader.cancel()
        for queue in self.streams.values():
            queue.put_nowait(LOST)
        self.streams.clear()
        self.socket.close()

    async def _read(self) -> None:
        while True:
            frame = await self.socket.recv()
            self.last_seen = time.monotonic()
            try:
                msg = p.unpack(frame)
            except p.ProtocolError as exc:
                log.warning("worker %s sent a bad frame: %s", self.worker_id, exc)
                continue
            if msg["type"] == p.HEARTBEAT:
                self.load.update(msg.get("load") or {})
                continue
            queue = self.streams.get(str(msg.get("request_id")))
            if queue is not None:
                queue.put_nowait(msg)


class WorkerPool:
    def __init__(self, discovery: Discovery, heartbeat_timeout_s: float = 1.5, poll_s: float = 0.2) -> None:
        self.discovery = discovery
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.poll_s = poll_s
        self.ctx = zmq.asyncio.Context.instance()
        self.connections: dict[str, WorkerConnection] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.refresh()
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for conn in list(self.connections.values()):
            conn.close()
        self.connections.clear()

    def pick(self, exclude: set[str]) -> WorkerConnection | None:
        """The live worker with the fewest requests in flight (the router issue refines this)."""
        candidates = [c for c in self.connections.values() if c.worker_id not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda c: (len(c.streams) + c.load.get("num_waiting", 0), c.worker_id))

    def drop(self, worker_id: str, reason: str) -> None:
        conn = self.connections.pop(worker_id, None)
        if conn is not None:
            log.warning("worker %s left (%s); %d requests to migrate", worker_id, reason, len(conn.streams))
            conn.close()

    def refresh(self) -> None:
        live = {w.worker_id: w for w in self.discovery.workers()}
        for worker_id, conn in list(self.connections.items()):
            info = live.get(worker_id)
            if info is None:
                self.drop(worker_id, "deregistered")
            elif info.incarnation != conn.info.incarnation:
                self.drop(worker_id, "restarted")
            elif time.monotonic() - conn.last_seen > self.heartbeat_timeout_s:
                self.drop(worker_id, "heartbeat timeout")
        for worker_id, info in live.items():
            if worker_id not in self.connections:
                log.info("worker %s joined at %s", worker_id, info.address)
                self.connections[worker_id] = WorkerConnection(info, self.ctx)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                self.refresh()
            except OSError as exc:
                log.warning("discovery poll failed: %s", exc)
