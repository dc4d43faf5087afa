"""Byte streams between agents: length-prefixed msgpack frames and raw payloads (never pickle).

A frame is a 4-byte little-endian length then a msgpack map. A payload is the raw bytes of a
descriptor list, in list order, right after the frame that announces it. Payloads move straight
from and into registered memory with vectored `sendmsg`/`recvmsg_into` (no staging copy, one
system call for many scattered blocks).

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
IOV_BATCH = 64  # pieces per sendmsg/recvmsg_into call (well under IOV_MAX = 1024)


class ByteStream:
    """One connected non-blocking socket, driven by the running event loop."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames are small, latency matters
        self.sock = sock
        self._loop = asyncio.get_running_loop()

    def close(self) -> None:
        self.sock.close()

    def shutdown(self) -> None:
        """Drop the connection under whoever is using it: their next send or receive fails."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed or never connected

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
        """Send the views' bytes back to back (vectored: scattered blocks need no staging copy)."""
        await self._vectored(views, sending=True)

    async def recv_views(self, views: Sequence[memoryview]) -> None:
        """Fill the views, in order, from the stream; EOF before the end raises `TransferError`."""
        await self._vectored(views, sending=False)

    async def _vectored(self, views: Sequence[memoryview], *, sending: bool) -> None:
        """sendmsg / recvmsg_into over up to IOV_BATCH views per call, waiting on the loop when
        the socket is not ready; the kernel gathers and scatters the pieces itself."""
        total = sum(v.nbytes for v in views)
        index, offset, moved = 0, 0, 0
        while index < len(views):
            batch = [views[index][offset:], *views[index + 1:index + IOV_BATCH]]
            try:
                n = self.sock.sendmsg(batch) if sending else self.sock.recvmsg_into(batch)[0]
            except (BlockingIOError, InterruptedError):
                await self._ready(writable=sending)
                continue
            if n == 0 and not sending:
                raise TransferError(f"peer closed the connection after {moved} of {total} payload bytes")
            moved += n
            n += offset
            while index < len(views) and n >= views[index].nbytes:
                n -= views[index].nbytes
                index += 1
            offset = n

    async def _ready(self, *, writable: bool) -> None:
        waiter = self._loop.create_future()
        fd = self.sock.fileno()
        if writable:
            self._loop.add_writer(fd, _wake, waiter)
        else:
            self._loop.add_reader(fd, _wake, waiter)
        try:
            await waiter
        finally:
            (self._loop.remove_writer if writable else self._loop.remove_reader)(fd)

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


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ConnectionPool:
    """Idle connections to one address (a (host, port) pair or a unix-socket path)."""

    def __init__(self, family: int, address: Any, connect_timeout: float = 10.0) -> None:
        self.family, self.address, self.connect_timeout = family, address, connect_timeout
        self._idle: list[ByteStream] = []
        self._busy: set[ByteStream] = set()
        self._closed = False

    @asynccontextmanager
    async def stream(self) -> AsyncIterator[ByteStream]:
        stream = await self._take()
        if self._closed:  # dropped while connecting
            stream.close()
            raise ConnectionError(f"connection to {self.address} dropped while connecting")
        self._busy.add(stream)
        try:
            yield stream
        except BaseException:
            stream.close()
            raise
        finally:
            self._busy.discard(stream)
        if self._closed:
            stream.close()
        else:
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
        """Close idle connections and drop the ones in use (their transfers fail)."""
        self._closed = True
        for stream in self._idle:
            stream.close()
        self._idle.clear()
        for stream in self._busy:
            stream.shutdown()
