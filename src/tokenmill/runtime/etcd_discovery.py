"""Discovery over etcd: `--discovery etcd://host:port[,host:port][/prefix]`.

A worker's `WorkerInfo` is a JSON value under `{prefix}{worker_id}`, attached to a lease of
`ttl_s` that a task keeps alive: a worker that dies (or loses etcd for longer than the TTL)
disappears from every frontend's view when the lease expires; no heartbeat files, no PID checks.
A worker that loses etcd keeps serving; once etcd answers again it grants a new lease and
writes its keys back. Frontends keep a local copy of the prefix (a full read, then a watch from
the next revision, and a full re-read every `RESYNC_S` and after any error); while etcd is
unreachable they keep the last set they saw.

The `Discovery` calls stay synchronous (callers run on the event loop and never wait on etcd):
writes are queued to the background task, `workers()` reads the local copy.

The client is aetcd: asyncio-native on grpc.aio, maintained, and it speaks the v3 API (leases,
watches) directly; the older `etcd3` package is synchronous and pins protobuf 3.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import aetcd
import aetcd.exceptions
import grpc

from tokenmill.runtime.worker_info import WorkerInfo

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/tokenmill/workers/"
RESYNC_S = 5.0
RETRY_S = 0.5
_ERRORS = (aetcd.exceptions.ClientError, grpc.RpcError, OSError, asyncio.TimeoutError)


def parse_etcd_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """`etcd://h:p[,h:p][/prefix]` -> endpoints and the key prefix (ending in '/')."""
    rest = url.removeprefix("etcd://")
    hosts, _, path = rest.partition("/")
    endpoints = []
    for part in filter(None, hosts.split(",")):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--discovery: {part!r} is not host:port (etcd://host:port[,host:port][/prefix])")
        endpoints.append((host, int(port)))
    if not endpoints:
        raise ValueError("--discovery: etcd:// needs at least one host:port")
    prefix = f"/{path.strip('/')}/" if path.strip("/") else DEFAULT_PREFIX
    return endpoints, prefix


class EtcdDiscovery:
    """Registration under a kept-alive lease, and a watched local copy of the registry."""

    def __init__(self, endpoints: list[tuple[str, int]], prefix: str = DEFAULT_PREFIX, ttl_s: float = 3.0) -> None:
        if ttl_s < 1:
            raise ValueError("--discovery-ttl-s must be at least 1 (etcd leases count whole seconds)")
        self.endpoints, self.prefix, self.ttl_s = endpoints, prefix, ttl_s
        self._mine: dict[str, WorkerInfo] = {}
        self._seen: dict[str, WorkerInfo] = {}
        self._dirty: set[str] = set()  # registered workers whose key must be (re)written
        self._gone: set[str] = set()  # unregistered workers whose key must be deleted
        self._published_at: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._lease: Any = None
        self._client: aetcd.Client | None = None
        self._endpoint = 0
        self._tasks: list[asyncio.Task] = []
        self._watch_task: asyncio.Task | None = None
        self.connected = False

    # -- Discovery ------------------------------------------------------------------------

    def register(self, info: WorkerInfo) -> None:
        info.heartbeat_at = time.time()
        self._mine[info.worker_id] = info
        self._gone.discard(info.worker_id)
        self._mark(info.worker_id)

    def heartbeat(self, worker_id: str, metadata: dict[str, Any] | None = None) -> None:
        """Liveness is the lease; the key is rewritten only when the worker starts draining or
        once per TTL (its load travels on the request plane, not through etcd)."""
        info = self._mine.get(worker_id)
        if info is None:
            return
        info.metadata.update(metadata or {})
        info.heartbeat_at = time.time()
        stale = time.monotonic() - self._published_at.get(worker_id, 0.0) >= self.ttl_s
        if stale or (metadata or {}).get("draining"):
            self._mark(worker_id)

    def unregister(self, worker_id: str) -> None:
        if self._mine.pop(worker_id, None) is not None:
            self._dirty.discard(worker_id)
            self._gone.add(worker_id)
            self._wake.set()

    def workers(self) -> list[WorkerInfo]:
        """The registry as last read; the first call (from the event loop) starts watching it,
        so a worker, which only registers, never holds a watch."""
        if self._watch_task is None and self._tasks:
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_loop())
            self._tasks.append(self._watch_task)
        return list(self._seen.values())

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect in the background (a missing etcd delays registration, never start-up)."""
        self._tasks = [asyncio.create_task(self._write_loop())]

    async def close(self, timeout_s: float = 2.0) -> None:
        """Delete this process's keys (best effort within `timeout_s`), then disconnect."""
        for worker_id in list(self._mine):
            self.unregister(worker_id)
        try:
            async with asyncio.timeout(timeout_s):
                while self._gone and self.connected:
                    await asyncio.sleep(0.02)
                if self._lease is not None and self.connected:
                    await self._lease.revoke()
        except (*_ERRORS, TimeoutError):
            pass
        for task in self._tasks:
            task.cancel()
        if self._tasks:  # a watch cancelled while aetcd was making it may never end: do not wait forever
            _, stuck = await asyncio.wait(self._tasks, timeout=timeout_s)
            if stuck:
                log.debug("%d etcd task(s) did not end within %.0f s of cancelling; leaving them to the process "
                          "exit", len(stuck), timeout_s)
        if self._client is not None:
            try:  # aetcd's watcher shutdown can wait forever on a watch cancelled while it was being made
                async with asyncio.timeout(timeout_s):
                    await self._client.close()
            except TimeoutError:
                log.debug("etcd client did not close within %.0f s; leaving it to the process exit", timeout_s)

    # -- background -----------------------------------------------------------------------

    def _mark(self, worker_id: str) -> None:
        self._dirty.add(worker_id)
        self._wake.set()

    async def _connect(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.endpoints[self._endpoint % len(self.endpoints)]
            self._client = aetcd.Client(host, port, timeout=max(1, int(self.ttl_s)))
        return self._client

    async def _drop_client(self, client: aetcd.Client, exc: BaseException) -> None:
        """After a failed call on `client`: forget the lease and (unless the other loop already
        did) the client, so the next call connects afresh, to the next endpoint."""
        if client is not self._client:
            return
        if self.connected:
            log.warning("etcd at %s unreachable (%s); keeping the last known workers",
                        self.endpoints[self._endpoint % len(self.endpoints)], exc)
        self.connected = False
        self._lease = None  # it may expire meanwhile: a fresh one on reconnect
        self._dirty.update(self._mine)
        self._client = None
        self._endpoint += 1  # the next endpoint, if there are several
        try:
            await client.close()
        except _ERRORS:
            pass

    async def _write_loop(self) -> None:
        """Keep the lease alive (every TTL/3) and flush queued writes and deletes."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.ttl_s / 3)
            except TimeoutError:
                pass
            self._wake.clear()
            await self._with_client(self._flush)

    async def _flush(self, client: aetcd.Client) -> None:
        if not self._mine and not self._gone:
            return
        if self._lease is not None:
            reply = await self._lease.refresh()
            if reply is None or reply.TTL <= 0:  # expired while we were away
                self._lease = None
        if self._lease is None and self._mine:
            self._lease = await client.lease(max(1, round(self.ttl_s)))
            self._dirty.update(self._mine)
        for worker_id in list(self._gone):
            await client.delete(self._key(worker_id))
            self._gone.discard(worker_id)
        for worker_id in list(self._dirty):
            info = self._mine.get(worker_id)
            self._dirty.discard(worker_id)
            if info is not None:
                await client.put(self._key(worker_id), json.dumps(asdict(info)).encode(), lease=self._lease)
                self._published_at[worker_id] = time.monotonic()
        if not self.connected:
            log.info("registered %s in etcd under %s", ", ".join(self._mine) or "nothing", self.prefix)
        self.connected = True

    async def _watch_loop(self) -> None:
        while True:
            await self._with_client(self._sync_and_watch)

    async def _with_client(self, step: Callable[[aetcd.Client], Awaitable[None]]) -> None:
        """One `step` on the current client; on an etcd error, drop that client and pause, so the
        caller's next turn connects afresh (to the next endpoint)."""
        client = await self._connect()
        try:
            await step(client)
        except _ERRORS as exc:
            await self._drop_client(client, exc)
            await asyncio.sleep(RETRY_S)

    async def _sync_and_watch(self, client: aetcd.Client) -> None:
        """Read the whole prefix, then apply watch events until the next resync."""
        listing = await client.get_prefix(self.prefix.encode())
        self._seen = {info.worker_id: info for info in map(_decode, (kv.value for kv in listing)) if info}
        self.connected = True
        revision = listing.header.revision if listing.header is not None else None
        watch = await client.watch_prefix(self.prefix.encode(), start_revision=None if revision is None else revision + 1)
        try:
            async with asyncio.timeout(RESYNC_S):
                async for event in watch:
                    self._apply(event)
        except TimeoutError:
            pass
        finally:
            await watch.cancel()

    def _apply(self, event: Any) -> None:
        worker_id = event.kv.key.decode().removeprefix(self.prefix)
        if event.kind == "DELETE":
            self._seen.pop(worker_id, None)
            return
        info = _decode(event.kv.value)
        if info is not None:
            self._seen[info.worker_id] = info

    def _key(self, worker_id: str) -> bytes:
        return f"{self.prefix}{worker_id}".encode()


def _decode(raw: bytes) -> WorkerInfo | None:
    try:
        return WorkerInfo(**json.loads(raw))
    except (ValueError, TypeError):
        return None
