"""Polling the engine behind a live server, and reading /metrics."""
from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import LiveServer
from tokenmill.engine.stats import EngineStats

_POLL_S = 0.05
_POLL_LIMIT_S = 20.0


def wait_until_idle(live: LiveServer) -> EngineStats:
    """The engine's stats once nothing runs, waits or holds KV (or the last seen, after the poll limit)."""
    deadline = time.monotonic() + _POLL_LIMIT_S
    while True:
        stats: EngineStats = live.call(live.engine.stats())
        idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0.0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(_POLL_S)


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(url: str, name: str, **labels: str) -> float:
    return metric_samples(url).get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for_metric(url: str, name: str, at_least: float, **labels: str) -> float:
    deadline = time.monotonic() + _POLL_LIMIT_S
    value = metric(url, name, **labels)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        value = metric(url, name, **labels)
    return value
