"""Scale to zero at the frontend: a request that finds no worker serving waits for one.

    waiting = EmptyPoolWait(wait_s=60.0)
    waiting.listeners.append(planner.wake)       # told at once when a request starts waiting
    joined = await waiting.wait(lambda: bool(pool.in_pool(prefill=False)), deadline)

Without it (no pool may be empty) a request to an empty pool is refused at once, as before. With
it the request waits, counted in `waiting` (the frontend's `tokenmill_requests_waiting_for_worker`,
which a planner in another process reads), until a worker joins, `wait_s` has passed or the
request's own deadline comes, whichever is first. Waiting holds nothing on any worker: a request
that gives up (or whose client leaves) has no KV to free.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.05  # how often the pool is looked at while requests wait (discovery is polled faster then)


class EmptyPoolWait:
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.waiting = 0
        self.listeners: list[Callable[[], None]] = []
        self._joined = asyncio.Event()  # set by the one watch below, however many requests wait
        self._watch: asyncio.Task[None] | None = None

    async def wait(self, ready: Callable[[], bool], deadline: float) -> bool:
        """True once `ready()` (a worker serves); False past `wait_s` or `deadline` (monotonic)."""
        until = min(deadline, time.monotonic() + self.wait_s)
        self.waiting += 1
        try:
            for listener in self.listeners:
                listener()
            if ready():
                return True
            if self._watch is None or self._watch.done():
                self._joined.clear()
                self._watch = asyncio.create_task(self._look(ready))
            try:
                await asyncio.wait_for(self._joined.wait(), max(until - time.monotonic(), 0.0))
            except TimeoutError:
                return ready()
            return True
        finally:
            self.waiting -= 1

    async def _look(self, ready: Callable[[], bool]) -> None:
        """While anyone waits: look at the pool every POLL_S; tell them all at once when it serves."""
        while self.waiting:
            if ready():
                self._joined.set()
                return
            await asyncio.sleep(POLL_S)
