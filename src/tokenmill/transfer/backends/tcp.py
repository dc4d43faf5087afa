"""`tcp`: move bytes over a TCP connection (across hosts and network namespaces).

Each agent runs one asyncio server (bind host configurable, default 127.0.0.1, port 0 = any)
that answers, per connection and in order:

- `{"op": "read", "descs": <encoded>}` → `{"ok": true, "bytes": n}` then the n payload bytes
  of its own descriptors, streamed back to back (one request per transfer: no per-descriptor
  round trips), or `{"ok": false, "error": ...}` when the descriptors are not valid here;
- `{"op": "write", "descs": <encoded>}` → `{"ok": ...}`; then the writer streams the payload and
  the server answers `{"ok": true}` once it has landed in its memory;
- `{"op": "notify", "sender", "message"}` → `{"ok": true}` once queued.

A connection that drops mid-payload fails the transfer on the client (the agent reports FAILED
with how many bytes had arrived); it is never reused.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any

from tokenmill.transfer.backends.server import FrameServer, NotificationSink, notify_handler, send_notification
from tokenmill.transfer.backends.stream import ByteStream, ConnectionPool
from tokenmill.transfer.descriptors import Descriptor, decode_descriptors, encode_descriptors, total_bytes
from tokenmill.transfer.handle import TransferError
from tokenmill.transfer.regions import BYTE_KINDS, PeerInfo, RegionTable

log = logging.getLogger(__name__)


class TcpBackend:
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None) -> None:
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host  # what peers dial (bind 0.0.0.0, advertise an IP)
        self._local: RegionTable | None = None
        self._server: FrameServer | None = None
        self._pools: dict[str, ConnectionPool] = {}
        self._agent = ""

    async def start(self, agent_name: str, local: RegionTable, sink: NotificationSink) -> dict[str, Any]:
        self._agent, self._local = agent_name, local
        listener = socket.create_server((self.host, self.port), reuse_port=False)
        handlers = {"read": self._serve_read, "write": self._serve_write, "notify": notify_handler(sink)}
        self._server = FrameServer(listener, handlers, f"tcp server of {agent_name!r}")
        self._server.start()
        port = listener.getsockname()[1]
        log.info("agent %r serves tcp on %s:%d", agent_name, self.host, port)
        return {"host": self.advertise_host, "port": port}

    def can_reach(self, peer: PeerInfo, remote_kinds: set[str], local_kinds: set[str]) -> bool:
        return "port" in peer.backends.get(self.name, {}) and (remote_kinds | local_kinds) <= BYTE_KINDS

    async def read(self, peer: PeerInfo, remote: Sequence[Descriptor], local: Sequence[Descriptor]) -> None:
        views = self._require_local().views(local)
        async with self._pool(peer).stream() as stream:
            await stream.send_frame({"op": "read", "descs": encode_descriptors(remote)})
            reply = await _expect_ok(stream, peer, "read")
            if reply.get("bytes") != total_bytes(local):
                raise TransferError(f"peer {peer.name!r} announced {reply.get('bytes')} bytes, "
                                    f"expected {total_bytes(local)}")
            await stream.recv_views(views)

    async def write(self, peer: PeerInfo, local: Sequence[Descriptor], remote: Sequence[Descriptor]) -> None:
        views = self._require_local().views(local)
        async with self._pool(peer).stream() as stream:
            await stream.send_frame({"op": "write", "descs": encode_descriptors(remote)})
            await _expect_ok(stream, peer, "write")
            await stream.send_views(views)
            await _expect_ok(stream, peer, "write completion")

    async def notify(self, peer: PeerInfo, message: bytes) -> None:
        async with self._pool(peer).stream() as stream:
            await send_notification(stream, self._agent, message)

    def forget(self, peer_name: str) -> None:
        pool = self._pools.pop(peer_name, None)
        if pool is not None:
            pool.close()

    async def close(self) -> None:
        for name in list(self._pools):
            self.forget(name)
        if self._server is not None:
            await self._server.close()
            self._server = None

    async def _serve_read(self, stream: ByteStream, request: dict[str, Any]) -> None:
        descs = await self._checked_request(stream, request)
        if descs is not None:
            await stream.send_frame({"ok": True, "bytes": total_bytes(descs)})
            await stream.send_views(self._require_local().views(descs))

    async def _serve_write(self, stream: ByteStream, request: dict[str, Any]) -> None:
        descs = await self._checked_request(stream, request)
        if descs is not None:
            await stream.send_frame({"ok": True})
            await stream.recv_views(self._require_local().views(descs))
            await stream.send_frame({"ok": True})

    async def _checked_request(self, stream: ByteStream, request: dict[str, Any]) -> list[Descriptor] | None:
        """The request's descriptors if they are valid here; otherwise answer with the error."""
        local = self._require_local()
        try:
            descs = decode_descriptors(request.get("descs") or {})
            local.validate(descs)
            if not local.kinds({d.region for d in descs}) <= BYTE_KINDS:
                raise ValueError("tcp moves only host and shm regions")
        except ValueError as exc:
            await stream.send_frame({"ok": False, "error": str(exc)})
            return None
        return descs

    def _pool(self, peer: PeerInfo) -> ConnectionPool:
        pool = self._pools.get(peer.name)
        if pool is None:
            info = peer.backends[self.name]
            pool = self._pools[peer.name] = ConnectionPool(socket.AF_INET, (info["host"], int(info["port"])))
        return pool

    def _require_local(self) -> RegionTable:
        if self._local is None:
            raise RuntimeError("the tcp backend is not started")
        return self._local


async def _expect_ok(stream: ByteStream, peer: PeerInfo, what: str) -> dict[str, Any]:
    reply = await stream.recv_frame()
    if not reply or not reply.get("ok"):
        raise TransferError(f"peer {peer.name!r} refused the {what}: {(reply or {}).get('error', 'no reply')}")
    return reply
