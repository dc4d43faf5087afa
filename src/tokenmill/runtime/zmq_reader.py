"""Read a ZeroMQ socket from the event loop without a future per message.

pyzmq's asyncio sockets make a future, callbacks and event-state bookkeeping for every
`recv` and every `send`; on the request plane, where a frame carries a few tokens, that
was most of the cost of a frame. `SocketReader` watches the socket's file descriptor and,
whenever it fires, drains every queued message into a plain callback. Sends go straight
to the (non-blocking) socket.

ZeroMQ's descriptor is edge-triggered and is also consumed by sends: after sending on a
socket, messages may be waiting without the descriptor firing again. Whoever sends on the
socket calls `poke()`, which schedules one more drain on the loop.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)


class SocketReader:
    def __init__(self, socket: zmq.Socket, on_message: Callable[[list[bytes]], None],
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.socket = socket
        self.on_message = on_message
        self.loop = loop or asyncio.get_running_loop()
        self._fd = socket.getsockopt(zmq.FD)
        self._poked = False
        self._closed = False
        self.loop.add_reader(self._fd, self._drain)
        self.poke()  # messages queued before we watched the descriptor raise no new edge

    def poke(self) -> None:
        """Drain once more on the next loop iteration (after a send on this socket)."""
        if not self._poked and not self._closed:
            self._poked = True
            self.loop.call_soon(self._drain)

    def close(self) -> None:
        """Deliver nothing more, also from a drain already scheduled."""
        self._closed = True
        self.loop.remove_reader(self._fd)

    def _drain(self) -> None:
        self._poked = False
        socket = self.socket
        if self._closed or socket.closed:
            return
        while socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.on_message(frames)
            except Exception:  # one bad message must not stop the reading
                log.exception("handling a message failed")
            if self._closed:  # the handler closed us
                return
