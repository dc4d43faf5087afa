"""`tokenmill serve` with KV tiers: flags reach the workers, `/admin/pin`, tier gauges in `/metrics`."""
from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.kv_tiers.helpers import RedisServer
from tests.serving.conftest import start_server, stop_server


def _metrics_with(url: str, needle: str, timeout_s: float = 20.0) -> str:
    """/metrics once it mentions `needle` (worker load arrives with heartbeats)."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=5).text
        if needle in text:
            break
        time.sleep(0.2)
    return text


def test_pin_endpoint_and_tier_metrics(tiny_dense: Path, tmp_path: Path, redis_server: RedisServer) -> None:
    server = start_server(tiny_dense, tmp_path / "run", "--kv-cache-blocks", "64", "--kv-host-gb", "0.01",
                          "--kv-shared", redis_server.url, "--kv-write-through", workers=2)
    try:
        assert "tokenmill_workers 2.0" in _metrics_with(server.url, "tokenmill_workers 2.0")  # both connected
        prefix = list(range(20, 84))
        answer = httpx.post(server.url + "/admin/pin", json={"prompt": prefix}, timeout=30)
        assert answer.status_code == 200
        body = answer.json()
        assert body["pinned"] is True and body["num_tokens"] == 64 and len(body["workers"]) == 2
        assert all(why is None for why in body["workers"].values())
        bad = httpx.post(server.url + "/admin/pin", json={"prompt": "x", "messages": []}, timeout=30)
        assert bad.status_code == 400
        done = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": prefix + [5, 6, 7], "max_tokens": 3})
        assert done.status_code == 200
        text = _metrics_with(server.url, 'tokenmill_worker_kv_tier_capacity_bytes{tier="shared"')
        for tier in ("host", "shared"):
            assert text.count(f'tokenmill_worker_kv_tier_capacity_bytes{{tier="{tier}"') == 2
        assert "tokenmill_worker_kv_tier_misses" in text and "tokenmill_worker_prefill_tokens" in text
    finally:
        stop_server(server)


def _worker_gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f"tokenmill_worker_{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def test_second_replica_serves_a_prefix_the_first_computed(tiny_dense: Path, tmp_path: Path,
                                                          redis_server: RedisServer) -> None:
    flags = ("--kv-cache-blocks", "64", "--kv-shared", redis_server.url, "--kv-write-through")
    first = start_server(tiny_dense, tmp_path / "a", *flags)
    second = start_server(tiny_dense, tmp_path / "b", *flags)
    try:
        corpus = list(range(30, 30 + 96))  # 6 full blocks
        for server, question in ((first, [7, 8, 9]), (second, [10, 11, 12])):
            done = httpx.post(server.url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": corpus + question, "max_tokens": 2})
            assert done.status_code == 200
        deadline = time.monotonic() + 20
        while _worker_gauge(second.url, "onboarded_tokens") < 96 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _worker_gauge(second.url, "onboarded_tokens") == 96
        assert _worker_gauge(second.url, "prefill_tokens") == 3  # only the question was computed
    finally:
        stop_server(first)
        stop_server(second)
