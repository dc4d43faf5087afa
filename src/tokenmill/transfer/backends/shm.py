"""`shm`: same-host transfers straight between shared-memory regions.

The peer's `shm` regions are files in the shared-memory directory; this backend maps them by name
(once per peer and region, pre-faulted) and copies: one memcpy per coalesced descriptor pair,
remote → local for a read, local → remote for a write. Big copies run in a worker thread through
numpy (which releases the GIL), so the event loop and the engine thread keep running; a cancelled
or timed-out copy stops between chunks and is waited for, so no byte lands after the handle says
FAILED.

Reachability: both agents publish their shared-memory domain (boot id + the shm directory's
device and inode) and the remote regions involved must be of kind "shm". Notifications travel
over a unix socket in the same directory.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenmill.transfer.backends.server import FrameServer, NotificationSink, notify_handler, send_notification
from tokenmill.transfer.backends.stream import ConnectionPool
from tokenmill.transfer.descriptors import Descriptor
from tokenmill.transfer.memory import SHM_DIR, SharedBuffer, private_shm_name, shm_domain
from tokenmill.transfer.regions import BYTE_KINDS, PeerInfo, RegionTable

log = logging.getLogger(__name__)

INLINE_COPY_BYTES = 256 << 10  # smaller transfers copy on the loop: a thread hop costs more
CHUNK_BYTES = 8 << 20  # big copies check for cancellation this often
NUMPY_COPY_BYTES = 64 << 10  # from here on numpy's GIL-free copy beats memoryview assignment


class ShmBackend:
    name = "shm"

    def __init__(self) -> None:
        self.domain = shm_domain()
        self._agent = ""
        self._local: RegionTable | None = None
        self._server: FrameServer | None = None
        self._socket_path = SHM_DIR / private_shm_name(".sock")
        self._mappings: dict[tuple[str, str], SharedBuffer] = {}
        self._pools: dict[str, ConnectionPool] = {}

    async def start(self, agent_name: str, local: RegionTable, sink: NotificationSink) -> dict[str, Any]:
        self._agent, self._local = agent_name, local
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self._socket_path))
        listener.listen()
        self._server = FrameServer(listener, {"notify": notify_handler(sink)}, f"shm notifications of {agent_name!r}")
        self._server.start()
        return {"domain": self.domain, "socket": str(self._socket_path)}

    def can_reach(self, peer: PeerInfo, remote_kinds: set[str], local_kinds: set[str]) -> bool:
        info = peer.backends.get(self.name, {})
        return info.get("domain") == self.domain and remote_kinds <= {"shm"} and local_kinds <= BYTE_KINDS

    async def read(self, peer: PeerInfo, remote: Sequence[Descriptor], local: Sequence[Descriptor]) -> None:
        await self._copy(self._remote_views(peer, remote), self._require_local().views(local))

    async def write(self, peer: PeerInfo, local: Sequence[Descriptor], remote: Sequence[Descriptor]) -> None:
        await self._copy(self._require_local().views(local), self._remote_views(peer, remote))

    async def notify(self, peer: PeerInfo, message: bytes) -> None:
        pool = self._pools.get(peer.name)
        if pool is None:
            pool = self._pools[peer.name] = ConnectionPool(socket.AF_UNIX, peer.backends[self.name]["socket"])
        async with pool.stream() as stream:
            await send_notification(stream, self._agent, message)

    def forget(self, peer_name: str) -> None:
        for key in [k for k in self._mappings if k[0] == peer_name]:
            self._mappings.pop(key).close()
        pool = self._pools.pop(peer_name, None)
        if pool is not None:
            pool.close()

    async def close(self) -> None:
        for peer_name in {k[0] for k in self._mappings} | set(self._pools):
            self.forget(peer_name)
        if self._server is not None:
            await self._server.close()
            self._server = None
            self._socket_path.unlink(missing_ok=True)

    def _remote_views(self, peer: PeerInfo, descs: Sequence[Descriptor]) -> list[memoryview]:
        out = []
        for d in descs:
            mapping = self._mappings.get((peer.name, d.region))
            if mapping is None:
                info = peer.regions[d.region]
                mapping = SharedBuffer.attach(info["shm_name"], int(info["length"]))
                self._mappings[(peer.name, d.region)] = mapping
            out.append(mapping.view[d.offset:d.offset + d.length])
        return out

    async def _copy(self, src: list[memoryview], dst: list[memoryview]) -> None:
        if sum(v.nbytes for v in src) <= INLINE_COPY_BYTES:
            copy_views(src, dst, threading.Event())
            return
        stop = threading.Event()
        copying = asyncio.get_running_loop().run_in_executor(None, copy_views, src, dst, stop)
        try:
            await asyncio.shield(copying)
        except asyncio.CancelledError:
            stop.set()  # and wait: the caller may reuse the destination as soon as we return
            await asyncio.wait([copying])
            raise

    def _require_local(self) -> RegionTable:
        if self._local is None:
            raise RuntimeError("the shm backend is not started")
        return self._local


def copy_views(src: Sequence[memoryview], dst: Sequence[memoryview], stop: threading.Event) -> None:
    """dst[i][:] = src[i] for each pair, stopping early once `stop` is set."""
    for s, d in zip(src, dst):
        if stop.is_set():
            return
        size = s.nbytes
        if size < NUMPY_COPY_BYTES:
            d[:] = s
            continue
        s_arr, d_arr = np.frombuffer(s, dtype=np.uint8), np.frombuffer(d, dtype=np.uint8)
        for start in range(0, size, CHUNK_BYTES):
            if stop.is_set():
                return
            np.copyto(d_arr[start:start + CHUNK_BYTES], s_arr[start:start + CHUNK_BYTES])
