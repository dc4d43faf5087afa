"""An agent's listening side: accept connections and answer framed requests, one at a time each.

Each request is a frame `{"op": ..., ...}`; the handler registered for the op answers on the same
stream (a reply frame, maybe followed or preceded by a payload). Requests on one connection are
served in order, which is what keeps a peer's notifications in order. A connection whose peer
vanishes mid-request is closed and logged; the server keeps serving the others.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from tokenmill.transfer.backends.stream import ByteStream
from tokenmill.transfer.handle import TransferError

log = logging.getLogger(__name__)

Handler = Callable[[ByteStream, dict[str, Any]], Awaitable[None]]
NotificationSink = Callable[[str, bytes], None]


class FrameServer:
    """Serves `handlers[op]` for every frame arriving on connections to `listener`."""

    def __init__(self, listener: socket.socket, handlers: Mapping[str, Handler], label: str) -> None:
        listener.setblocking(False)
        self.listener, self.handlers, self.label = listener, dict(handlers), label
        self._accept_task: asyncio.Task[None] | None = None
        self._connections: dict[asyncio.Task[None], ByteStream] = {}

    def start(self) -> None:
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self.listener)
            stream = ByteStream(conn)
            task = loop.create_task(self._serve(stream))
            self._connections[task] = stream
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        stream = self._connections.pop(task, None)
        if stream is not None:
            stream.close()

    async def _serve(self, stream: ByteStream) -> None:
        try:
            while (request := await stream.recv_frame(eof_ok=True)) is not None:
                handler = self.handlers.get(request.get("op"))
                if handler is None:
                    await stream.send_frame({"ok": False, "error": f"{self.label}: unknown op {request.get('op')!r}"})
                    continue
                await handler(stream, request)
        except (TransferError, OSError, ValueError) as exc:
            log.info("%s: dropped a connection: %s", self.label, exc)

    async def close(self) -> None:
        """Stop accepting and drop every connection (in-flight requests end on the peer as FAILED)."""
        tasks = [t for t in (self._accept_task, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in list(self._connections.values()):
            stream.close()
        self.listener.close()


def notify_handler(sink: NotificationSink) -> Handler:
    """The "notify" op every backend serves: hand the message to the agent, then acknowledge."""

    async def handle(stream: ByteStream, request: dict[str, Any]) -> None:
        sender, message = request.get("sender"), request.get("message")
        if not isinstance(sender, str) or not isinstance(message, bytes):
            await stream.send_frame({"ok": False, "error": "notify needs a str sender and bytes message"})
            return
        sink(sender, message)
        await stream.send_frame({"ok": True})

    return handle


async def send_notification(stream: ByteStream, sender: str, message: bytes) -> None:
    """Client side of "notify": returns once the peer has queued the message."""
    await stream.send_frame({"op": "notify", "sender": sender, "message": message})
    reply = await stream.recv_frame()
    if not reply or not reply.get("ok"):
        raise TransferError(f"notification refused: {(reply or {}).get('error', 'no reply')}")
