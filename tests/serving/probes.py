"""What the multi-process serving tests ask a running frontend over HTTP, and how they wait."""
from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of every sample called `name` (with these labels) on the frontend's /metrics; 0 if none."""
    text = httpx.get(f"{base}/metrics", timeout=5, trust_env=False).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def answers(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v1/models", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def wait(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
