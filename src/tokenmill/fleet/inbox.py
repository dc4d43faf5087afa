"""One request's frames from its worker, as the request's coroutine waits for them.

An `asyncio.Queue` read through `asyncio.wait_for` makes a task and a timeout per frame;
a stream of tokens needs only a list and one future to wake its reader.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any


class StreamInbox:
    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[dict[str, Any]] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, message: dict[str, Any]) -> None:
        self._items.append(message)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def peek(self) -> dict[str, Any] | None:
        return self._items[0] if self._items else None

    def get_nowait(self) -> dict[str, Any] | None:
        return self._items.popleft() if self._items else None

    async def get(self, deadline: float) -> dict[str, Any] | None:
        """The next frame, or None once `deadline` (time.monotonic) has passed."""
        if self._items:
            return self._items.popleft()
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(max(0.0, deadline - time.monotonic()), _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        return self._items.popleft() if self._items else None


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
