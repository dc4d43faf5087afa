"""The dashboard's stream: the state first, then the markers and points it kept, then what happens;
each point over the window its subscriber asked for; a subscriber that stops reading is ended."""
from __future__ import annotations

import asyncio
import json

import pytest

from tokenmill.api.dashboard import stream as stream_module
from tokenmill.api.dashboard.stream import Sampler
from tokenmill.api.metrics import FrontendMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def _events(frames: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for frame in frames:
        event, data = frame.decode().strip().split("\n")
        out.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(stream_module, "time", clock)
    return clock


def test_a_subscriber_gets_the_state_the_history_and_then_the_news(clock: Clock) -> None:
    metrics = FrontendMetrics(dict)
    state = {"settings": {"kv_routing": True}}
    sampler = Sampler(metrics.registry.collect, lambda: 16, lambda: state)

    async def run() -> list[tuple[str, dict]]:
        for second in range(12):  # one snapshot a second; a token streamed before each
            clock.now = 1000.0 + second
            metrics.generated_tokens.inc()
            sampler.sample()
        sampler.mark("cache off")
        events = sampler.events(window_s=4.0)
        frames = [await anext(events) for _ in range(1 + 1 + 11)]  # state, the marker, points 2..12
        state["settings"]["kv_routing"] = False
        clock.now += 1
        sampler.mark("KV routing off")
        frames += [await anext(events), await anext(events)]  # the marker, then the state after it
        metrics.generated_tokens.inc()
        sampler.sample()
        frames.append(await anext(events))
        await events.aclose()
        return _events(frames)

    events = asyncio.run(run())
    assert events[0] == ("state", {"settings": {"kv_routing": True}})
    assert events[1][0] == "marker" and events[1][1]["label"] == "cache off"
    points = [data for kind, data in events if kind == "point"]
    assert len(points) == 12
    # a point's window reaches back to the snapshot at or before its start: 4 s (1 s at the first)
    assert [p["window_s"] for p in points[:5]] == [1.0, 2.0, 3.0, 4.0, 4.0]
    assert points[4]["output_tokens"] == 4  # the tokens observed in its 4 s
    assert events[-3][1]["label"] == "KV routing off" and events[-2] == ("state", {"settings": {"kv_routing": False}})
    assert events[-1][0] == "point" and events[-1][1]["window_s"] == 4.0 and events[-1][1]["output_tokens"] == 4
    assert not sampler._subscribers  # closed: unsubscribed


def test_a_subscriber_that_stops_reading_is_ended(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_module, "SUBSCRIBER_BACKLOG", 3)
    sampler = Sampler(FrontendMetrics(dict).registry.collect, lambda: 16, dict)

    async def run() -> list[bytes]:
        events = sampler.events()
        first = await anext(events)  # the state: subscribed now
        for _ in range(10):  # far more than it reads
            clock.now += 1
            sampler.sample()
        rest = [frame async for frame in events]
        return [first, *rest]

    frames = asyncio.run(run())
    assert _events(frames)[0][0] == "state" and len(frames) == 1  # its backlog dropped, its stream ended
    assert not sampler._subscribers
