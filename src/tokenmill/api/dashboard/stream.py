"""The dashboard's live stream: a snapshot of the frontend's own metrics every second, markers for
every change an operator makes, and the server-sent events that carry both to the page.

`Sampler.run` takes a `figures.Snapshot` of the metrics registry each `interval_s` and keeps
`keep_s` of them. A subscriber (one `/dashboard/events` connection; one that falls
SUBSCRIBER_BACKLOG events behind is ended) gets, as SSE events:
`state` (the toggles and scenarios, on connect and after every change), `marker` (a change, with
its time and label: the page draws it on every chart) and `point` (the figures over its window
ending at each snapshot; the history first, so a page opened late shows what happened).
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from tokenmill.api.dashboard.figures import Snapshot, snapshot, window

log = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 5.0
MAX_WINDOW_S = 600.0
SUBSCRIBER_BACKLOG = 256  # events a slow page may fall behind before it is dropped


@dataclass(slots=True, frozen=True)
class Marker:
    t: float
    label: str

    def to_json(self) -> dict[str, Any]:
        return {"t": round(self.t, 3), "label": self.label}


class Sampler:
    """`collect()` yields the registry's metric families; `state()` is the toggles' and scenarios' JSON."""

    def __init__(self, collect: Callable[[], Iterable[Any]], block_size: Callable[[], int],
                 state: Callable[[], dict[str, Any]], interval_s: float = 1.0, keep_s: float = 900.0) -> None:
        self.collect, self.block_size, self.state = collect, block_size, state
        self.interval_s = interval_s
        self.snapshots: deque[Snapshot] = deque(maxlen=max(2, int(keep_s / interval_s)))
        self.markers: deque[Marker] = deque(maxlen=256)
        self._subscribers: set[asyncio.Queue[tuple[str, Any]]] = set()

    async def run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # a broken sample must not end the stream for good
                log.exception("sampling the metrics for the dashboard failed")
            await asyncio.sleep(self.interval_s)

    def sample(self) -> Snapshot:
        snap = snapshot(self.collect(), time.time())
        self.snapshots.append(snap)
        self._publish("point", snap)
        return snap

    def mark(self, label: str) -> None:
        """A change the operator made: a marker on the charts, and the new state."""
        marker = Marker(time.time(), label)
        self.markers.append(marker)
        self._publish("marker", marker)
        self.state_changed()

    def state_changed(self) -> None:
        self._publish("state", None)

    def point(self, snap: Snapshot, window_s: float) -> dict[str, Any]:
        """The figures over the `window_s` before `snap` (from the snapshot at or before its start)."""
        times = [s.t for s in self.snapshots]
        i = max(bisect.bisect_right(times, snap.t - window_s) - 1, 0)
        return window(self.snapshots[i], snap, self.block_size())

    async def events(self, window_s: float = DEFAULT_WINDOW_S) -> AsyncIterator[bytes]:
        """One subscriber's SSE frames: the state, the history, then everything as it happens."""
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(SUBSCRIBER_BACKLOG)
        self._subscribers.add(queue)
        markers, history = list(self.markers), list(self.snapshots)[1:]  # what came before it subscribed
        try:
            yield _frame("state", self.state())
            for marker in markers:
                yield _frame("marker", marker.to_json())
            for snap in history:
                yield _frame("point", self.point(snap, window_s))
            while True:
                kind, item = await queue.get()
                if kind == "end":
                    return
                if kind == "point":
                    yield _frame("point", self.point(item, window_s))
                elif kind == "marker":
                    yield _frame("marker", item.to_json())
                else:
                    yield _frame("state", self.state())
        finally:
            self._subscribers.discard(queue)

    def _publish(self, kind: str, item: Any) -> None:
        for queue in list(self._subscribers):
            try:
                queue.put_nowait((kind, item))
            except asyncio.QueueFull:  # a page that stopped reading: end its stream (it reconnects, replays)
                log.warning("a dashboard stream fell %d events behind; ending it", queue.maxsize)
                self._subscribers.discard(queue)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(("end", None))


def _frame(event: str, data: Any) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
