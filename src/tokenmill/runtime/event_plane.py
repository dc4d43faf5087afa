"""The NATS event plane: `--event-plane nats://host:port[,host:port]` (nats-py, imported only by
processes given the flag).

Workers publish their KV-event frames (the same msgpack frames as on the embedded ZeroMQ PUB
socket) on `kv_subject(model, worker)`; any number of frontends subscribe, each for the workers
it knows. Event ids and the gap -> snapshot path are unchanged: a frame lost while NATS was away
shows as a gap in the ids, and the router asks that worker for a snapshot over the request plane.

Neither side waits for NATS: a worker whose NATS is away drops its frames (the ids carry the
loss), a frontend keeps routing on what it has (the router's "events stale" signal rises if the
silence lasts) and, when the connection comes back, asks every worker for a snapshot
(`on_reconnect`), so its index is whole again without waiting for the next event.
"""
from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import nats
import nats.errors

log = logging.getLogger(__name__)

RETRY_S = 0.5
_SUBJECT_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def kv_subject(model: str, worker_id: str) -> str:
    """`tokenmill.kv.<model>.<worker>`: one subject per model and worker (tokens made subject-safe)."""
    return f"tokenmill.kv.{_SUBJECT_UNSAFE.sub('_', model)}.{_SUBJECT_UNSAFE.sub('_', worker_id)}"


def parse_event_plane(url: str) -> list[str]:
    """`nats://h:p[,h:p]` -> the server URLs; ValueError naming the flag."""
    if not url.startswith("nats://"):
        raise ValueError(f"--event-plane must be nats://host:port[,host:port], got {url!r}")
    servers = []
    for part in filter(None, url.removeprefix("nats://").split(",")):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--event-plane: {part!r} is not host:port")
        servers.append(f"nats://{host}:{port}")
    if not servers:
        raise ValueError("--event-plane: nats:// needs at least one host:port")
    return servers


class NatsEventPlane:
    """One NATS connection per process, made and kept in the background."""

    def __init__(self, servers: list[str], name: str) -> None:
        self.servers, self.name = servers, name
        self.on_reconnect: Callable[[], None] | None = None
        self._nc: Any = None
        self._wanted: dict[str, Callable[[bytes], None]] = {}  # subject -> handler
        self._subscriptions: dict[str, Any] = {}
        self._task: asyncio.Task | None = None
        self._closing = False
        self.dropped_frames = 0

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def start(self) -> None:
        self._task = asyncio.create_task(self._connect())

    async def close(self) -> None:
        self._closing = True  # the disconnect that follows is ours, not an outage
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()

    def publish(self, subject: str, frame: bytes) -> None:
        """Fire and forget: while NATS is away the frame is dropped (the ids show the gap)."""
        if not self.connected:
            self.dropped_frames += 1
            return
        asyncio.get_running_loop().create_task(self._publish(subject, frame))

    def subscribe(self, subject: str, handler: Callable[[bytes], None]) -> None:
        self._wanted[subject] = handler
        if self.connected:
            asyncio.get_running_loop().create_task(self._subscribe(subject))

    def unsubscribe(self, subject: str) -> None:
        self._wanted.pop(subject, None)
        subscription = self._subscriptions.pop(subject, None)
        if subscription is not None and self.connected:
            asyncio.get_running_loop().create_task(_quietly(subscription.unsubscribe()))

    async def _connect(self) -> None:
        while True:
            try:
                self._nc = await nats.connect(self.servers, name=self.name, allow_reconnect=True,
                                              max_reconnect_attempts=-1, reconnect_time_wait=RETRY_S,
                                              connect_timeout=2, disconnected_cb=self._disconnected,
                                              reconnected_cb=self._reconnected)
                break
            except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
                log.info("NATS at %s not reachable yet (%s); retrying", ",".join(self.servers), exc)
                await asyncio.sleep(RETRY_S)
        log.info("event plane: connected to NATS at %s", self._nc.connected_url.netloc)
        for subject in list(self._wanted):
            await self._subscribe(subject)
        if self.on_reconnect is not None:
            self.on_reconnect()

    async def _subscribe(self, subject: str) -> None:
        if subject in self._subscriptions or subject not in self._wanted:
            return
        handler = self._wanted[subject]

        async def deliver(msg: Any) -> None:
            handler(msg.data)

        self._subscriptions[subject] = await self._nc.subscribe(subject, cb=deliver)

    async def _publish(self, subject: str, frame: bytes) -> None:
        try:
            await self._nc.publish(subject, frame)
        except (nats.errors.Error, OSError) as exc:  # one dropped frame, shown by the ids
            self.dropped_frames += 1
            log.debug("dropped a KV-event frame on %s: %s", subject, exc)

    async def _disconnected(self) -> None:
        if self._closing:
            return
        log.warning("event plane: NATS connection lost; routing on the last known KV state")

    async def _reconnected(self) -> None:
        log.info("event plane: NATS is back; asking the workers for snapshots")
        if self.on_reconnect is not None:
            self.on_reconnect()


async def _quietly(coro: Any) -> None:
    try:
        await coro
    except (nats.errors.Error, OSError) as exc:  # an unsubscribe on a dying connection
        log.debug("unsubscribe failed: %s", exc)
