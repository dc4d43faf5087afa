"""Byte streams between agents: length-prefixed msgpack frames and raw payloads (never pickle).

A frame is a 4-byte little-endian length then a msgpack map. A payload is the raw bytes of a
descriptor list, in list order, right after the frame that announces it. Small pieces (scattered
KV blocks) go through a staging buffer so the socket sees large sends and receives, while large
pieces move straight from and into registered memory (no extra copy).

`ConnectionPool` keeps idle connections to one peer address; a connection that raised mid-use is
closed, never reused, because its stream position is unknown.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgpack

from tokenmill.transfer.handle import TransferError

log = logging.getLogger(__name__)

FRAME_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 256 << 20  # a descriptor table of ~11M entries; anything larger is an error
STAGE_BYTES = 4 << 20
SMALL_PIECE_BYTES = 256 << 10  # below this, pieces are batched through the staging buffer


class ByteStream:
    """One connected non-blocking socket, driven by the running event loop."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames are small, latency matters
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._stage = bytearray(0)

    def close(self) -> None:
        self.sock.close()

    def is_alive(self) -> bool:
        """False when the peer closed an idle connection (or something unexpected is buffered)."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)  # b"" (closed) or stray bytes: either way unusable
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    async def send_frame(self, obj: dict[str, Any]) -> None:
        body = msgpack.packb(obj, use_bin_type=True)
        await self._loop.sock_sendall(self.sock, FRAME_LENGTH.pack(len(body)) + body)

    async def recv_frame(self, *, eof_ok: bool = False) -> dict[str, Any] | None:
        """The next frame; None at a clean end of stream when `eof_ok`."""
        head = await self._recv_exactly(FRAME_LENGTH.size, eof_ok=eof_ok)
        if head is None:
            return None
        (size,) = FRAME_LENGTH.unpack(head)
        if size > MAX_FRAME_BYTES:
            raise TransferError(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
        obj = msgpack.unpackb(await self._recv_exactly(size), raw=False)
        if not isinstance(obj, dict):
            raise TransferError(f"expected a msgpack map frame, got {type(obj).__name__}")
        return obj

    async def send_views(self, views: Sequence[memoryview]) -> None:
        """Send the views' bytes back to back."""
        stage, fill = self._staging(), 0
        for view in views:
            size = view.nbytes
            if size >= SMALL_PIECE_BYTES or fill + size > len(stage):
                if fill:
                    await self._loop.sock_sendall(self.sock, memoryview(stage)[:fill])
                    fill = 0
                if size >= SMALL_PIECE_BYTES:
                    await self._loop.sock_sendall(self.sock, view)
                    continue
            stage[fill:fill + size] = view
            fill += size
        if fill:
            await self._loop.sock_sendall(self.sock, memoryview(stage)[:fill])

    async def recv_views(self, views: Sequence[memoryview]) -> None:
        """Fill the views, in order, from the stream; EOF before the end raises `TransferError`."""
        progress = _Progress(sum(v.nbytes for v in views))
        group: list[memoryview] = []
        group_bytes = 0
        for view in views:
            size = view.nbytes
            if size >= SMALL_PIECE_BYTES or group_bytes + size > STAGE_BYTES:
                await self._recv_group(group, group_bytes, progress)
                group, group_bytes = [], 0
                if size >= SMALL_PIECE_BYTES:
                    await self._recv_into(view, progress)
                    continue
            group.append(view)
            group_bytes += size
        await self._recv_group(group, group_bytes, progress)

    async def _recv_group(self, group: list[memoryview], group_bytes: int, progress: _Progress) -> None:
        if not group:
            return
        staged = memoryview(self._staging())[:group_bytes]
        await self._recv_into(staged, progress)
        pos = 0
        for view in group:  # scatter the staged bytes to their destinations
            view[:] = staged[pos:pos + view.nbytes]
            pos += view.nbytes

    async def _recv_into(self, view: memoryview, progress: _Progress) -> None:
        got = 0
        while got < view.nbytes:
            n = await self._loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise TransferError(f"peer closed the connection after {progress.done + got} "
                                    f"of {progress.total} payload bytes")
            got += n
        progress.done += got

    async def _recv_exactly(self, size: int, *, eof_ok: bool = False) -> bytes | None:
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = await self._loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                if eof_ok and got == 0:
                    return None
                raise TransferError(f"peer closed the connection inside a {size}-byte frame")
            got += n
        return bytes(buf)

    def _staging(self) -> bytearray:
        if not self._stage:  # allocated on first use: notification-only streams never need it
            self._stage = bytearray(STAGE_BYTES)
        return self._stage


class _Progress:
    __slots__ = ("total", "done")

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0


class ConnectionPool:
    """Idle connections to one address (a (host, port) pair or a unix-socket path)."""

    def __init__(self, family: int, address: Any, connect_timeout: float = 10.0) -> None:
        self.family, self.address, self.connect_timeout = family, address, connect_timeout
        self._idle: list[ByteStream] = []

    @asynccontextmanager
    async def stream(self) -> AsyncIterator[ByteStream]:
        stream = await self._take()
        try:
            yield stream
        except BaseException:
            stream.close()
            raise
        self._idle.append(stream)

    async def _take(self) -> ByteStream:
        while self._idle:
            stream = self._idle.pop()
            if stream.is_alive():
                return stream
            stream.close()
        sock = socket.socket(self.family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, self.address),
                                   self.connect_timeout)
        except BaseException:
            sock.close()
            raise
        return ByteStream(sock)

    def close(self) -> None:
        for stream in self._idle:
            stream.close()
        self._idle.clear()
