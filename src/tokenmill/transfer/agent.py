"""`TransferAgent`: one per worker; moves bytes between its registered memory and a peer's.

    agent = TransferAgent("prefill-0")              # backends ("shm", "tcp") by default
    await agent.start()                             # servers up; now metadata() is complete
    agent.register(pool.region("kv"))               # pool = allocate_shared_tensor(...)
    publish(agent.metadata())                       # msgpack-able dict: name, regions, backends

    peer = decode_agent.add_remote(metadata)        # on the other side
    handle = decode_agent.read(peer, remote_descs, local_descs, expected_checksum=c, timeout=5)
    if await handle.wait() is TransferStatus.DONE: ...   # else handle.reason; never use the bytes
    await decode_agent.notify(peer, b"ack ...")     # arrives, in order, at agent.next_notification()

Descriptor lists are (source, destination) in that order for both `read(remote, remote_descs,
local_descs)` and `write(remote, local_descs, remote_descs)`. Bad input (unknown peer or region,
out-of-range bytes, unequal pair lengths, no backend that reaches the peer) raises `ValueError`
at the call; trouble while moving (dropped connection, timeout, checksum mismatch, cancel) ends
the handle FAILED with a reason. Backend choice: the first of this agent's backends, in the
order given, that the peer also runs and that reaches it for the regions involved (shm on one
host, else tcp); `backend=` forces one.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import xxhash

from tokenmill.transfer.backends import Backend, make_backend
from tokenmill.transfer.descriptors import Descriptor, coalesce_pairs, total_bytes
from tokenmill.transfer.handle import Notification, TransferError, TransferHandle, TransferStatus
from tokenmill.transfer.memory import MemoryRegion
from tokenmill.transfer.regions import PeerInfo, RegionTable

log = logging.getLogger(__name__)

METADATA_VERSION = 1
THREAD_CHECKSUM_BYTES = 1 << 20


class TransferAgent:
    """Registers memory regions and runs READ/WRITE transfers and notifications with peers."""

    def __init__(self, name: str, backends: Sequence[str | Backend] = ("shm", "tcp")) -> None:
        if not name:
            raise ValueError("an agent needs a non-empty name")
        self.name = name
        self.regions = RegionTable(name)
        self._backends = [make_backend(b) if isinstance(b, str) else b for b in backends]
        if not self._backends or len({b.name for b in self._backends}) != len(self._backends):
            raise ValueError(f"agent {name!r} needs at least one backend, each once")
        self._backend_info: dict[str, dict[str, Any]] = {}
        self._peers: dict[str, PeerInfo] = {}
        self._notifications: asyncio.Queue[Notification] = asyncio.Queue()
        self._notify_locks: dict[str, asyncio.Lock] = {}
        self._in_flight: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        for backend in self._backends:
            self._backend_info[backend.name] = await backend.start(self.name, self.regions, self._deliver)

    async def close(self) -> None:
        """Fail what is in flight, drop peers, stop the backends (regions stay the caller's)."""
        for task in list(self._in_flight):
            task.cancel()
        await asyncio.gather(*self._in_flight, return_exceptions=True)
        for peer in list(self._peers):
            self.remove_remote(peer)
        for backend in self._backends:
            await backend.close()

    async def __aenter__(self) -> TransferAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def register(self, region: MemoryRegion) -> None:
        """Make `region` transferable; publish `metadata()` again so peers learn of it."""
        self.regions.register(region)

    def deregister(self, name: str) -> MemoryRegion:
        return self.regions.deregister(name)

    def metadata(self) -> dict[str, Any]:
        """What a peer passes to `add_remote`: msgpack-able, no pointers."""
        if not self._backend_info:
            raise RuntimeError(f"agent {self.name!r}: start() before publishing metadata")
        return {"version": METADATA_VERSION, "name": self.name, "regions": self.regions.describe(),
                "backends": {name: dict(info) for name, info in self._backend_info.items()}}

    def add_remote(self, metadata: dict[str, Any]) -> str:
        """Learn (or refresh) a peer from its metadata; returns its name."""
        peer = PeerInfo.from_metadata(metadata)
        if peer.name in self._peers:
            self.remove_remote(peer.name)
        self._peers[peer.name] = peer
        return peer.name

    def remove_remote(self, name: str) -> None:
        self._peers.pop(name, None)
        for backend in self._backends:
            backend.forget(name)

    def read(self, remote: str, remote_descs: Sequence[Descriptor], local_descs: Sequence[Descriptor], *,
             expected_checksum: int | None = None, timeout: float | None = None,
             backend: str | None = None) -> TransferHandle:
        """Copy the peer's `remote_descs` into this agent's `local_descs`, asynchronously.

        With `expected_checksum` (the peer's `checksum()` of its bytes), the handle is DONE only
        if the local bytes hash to it afterwards."""
        peer, chosen, src, dst = self._plan(remote, remote_descs, local_descs, backend, remote_is_source=True)
        handle = TransferHandle("read", peer.name, chosen.name, total_bytes(dst), len(dst))
        return self._launch(handle, lambda: chosen.read(peer, src, dst), timeout, expected_checksum, dst)

    def write(self, remote: str, local_descs: Sequence[Descriptor], remote_descs: Sequence[Descriptor], *,
              timeout: float | None = None, backend: str | None = None) -> TransferHandle:
        """Copy this agent's `local_descs` into the peer's `remote_descs`, asynchronously."""
        peer, chosen, src, dst = self._plan(remote, remote_descs, local_descs, backend, remote_is_source=False)
        handle = TransferHandle("write", peer.name, chosen.name, total_bytes(src), len(src))
        return self._launch(handle, lambda: chosen.write(peer, src, dst), timeout, None, src)

    def checksum(self, local_descs: Sequence[Descriptor]) -> int:
        """xxh3-64 of the bytes `local_descs` name, in order (independent of how they are cut)."""
        self.regions.validate(local_descs)
        return checksum_views(self.regions.views(local_descs))

    async def notify(self, remote: str, message: bytes) -> None:
        """Deliver `message` to the peer's notification queue; returns once it is queued there.
        Messages to one peer arrive in the order of the calls."""
        peer = self._peer(remote)
        backend = self._choose(peer, set(), set(), None)
        async with self._notify_locks.setdefault(peer.name, asyncio.Lock()):
            await backend.notify(peer, bytes(message))

    async def next_notification(self, timeout: float | None = None) -> Notification:
        """The oldest undelivered notification; `TimeoutError` after `timeout` seconds."""
        async with asyncio.timeout(timeout):
            return await self._notifications.get()

    async def notifications(self) -> AsyncIterator[Notification]:
        while True:
            yield await self._notifications.get()

    def _deliver(self, sender: str, message: bytes) -> None:
        self._notifications.put_nowait(Notification(sender, message))

    def _peer(self, name: str) -> PeerInfo:
        peer = self._peers.get(name)
        if peer is None:
            raise ValueError(f"agent {self.name!r} does not know peer {name!r}; add_remote() its metadata first")
        return peer

    def _plan(self, remote: str, remote_descs: Sequence[Descriptor], local_descs: Sequence[Descriptor],
              forced: str | None, *, remote_is_source: bool,
              ) -> tuple[PeerInfo, Backend, list[Descriptor], list[Descriptor]]:
        """Validate both sides, pick a backend, coalesce; returns (peer, backend, source, destination)."""
        peer = self._peer(remote)
        peer.validate(remote_descs)
        self.regions.validate(local_descs)
        chosen = self._choose(peer, peer.kinds({d.region for d in remote_descs}),
                              self.regions.kinds({d.region for d in local_descs}), forced)
        if remote_is_source:
            src, dst = coalesce_pairs(remote_descs, local_descs)
        else:
            src, dst = coalesce_pairs(local_descs, remote_descs)
        return peer, chosen, src, dst

    def _choose(self, peer: PeerInfo, remote_kinds: set[str], local_kinds: set[str], forced: str | None) -> Backend:
        for backend in self._backends:
            if forced not in (None, backend.name):
                continue
            if backend.name in peer.backends and backend.can_reach(peer, remote_kinds, local_kinds):
                return backend
        wanted = forced or " or ".join(b.name for b in self._backends)
        raise ValueError(f"agent {self.name!r} has no {wanted} backend that reaches peer {peer.name!r} "
                         f"(peer runs {sorted(peer.backends)}; region kinds remote {sorted(remote_kinds)}, "
                         f"local {sorted(local_kinds)})")

    def _launch(self, handle: TransferHandle, move: Callable[[], Coroutine[Any, Any, None]], timeout: float | None,
                expected_checksum: int | None, destination: list[Descriptor]) -> TransferHandle:
        task = asyncio.get_running_loop().create_task(
            self._run(handle, move, timeout, expected_checksum, destination))
        handle._task = task
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        # a task cancelled before its first step never runs _run's handlers
        task.add_done_callback(lambda _: handle.complete(TransferStatus.FAILED, "cancelled"))
        return handle

    async def _run(self, handle: TransferHandle, move: Callable[[], Coroutine[Any, Any, None]],
                   timeout: float | None, expected_checksum: int | None, destination: list[Descriptor]) -> None:
        try:
            async with asyncio.timeout(timeout):
                await move()
            if expected_checksum is not None:
                handle.checksum = await self._checksum_async(destination)
                if handle.checksum != expected_checksum:
                    raise TransferError(f"checksum mismatch: expected {expected_checksum:016x}, "
                                        f"received bytes hash to {handle.checksum:016x}")
            handle.complete(TransferStatus.DONE)
        except TimeoutError:
            handle.complete(TransferStatus.FAILED, f"timed out after {timeout:g} s")
        except asyncio.CancelledError:  # handle.cancel() or close(): the handle is the only result
            handle.complete(TransferStatus.FAILED, "cancelled")
        except Exception as exc:  # the handle must always complete; the reason says what went wrong
            reason = str(exc) if isinstance(exc, TransferError) else f"{type(exc).__name__}: {exc}"
            log.warning("%s %s peer %r failed: %s", handle.backend, handle.op, handle.peer, reason)
            handle.complete(TransferStatus.FAILED, reason)

    async def _checksum_async(self, descs: list[Descriptor]) -> int:
        views = self.regions.views(descs)
        if total_bytes(descs) < THREAD_CHECKSUM_BYTES:
            return checksum_views(views)
        return await asyncio.to_thread(checksum_views, views)


def checksum_views(views: Sequence[memoryview]) -> int:
    hasher = xxhash.xxh3_64()
    for view in views:
        hasher.update(view)
    return hasher.intdigest()
