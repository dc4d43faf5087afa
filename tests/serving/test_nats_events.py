"""KV events over a real NATS: a `tokenmill serve --event-plane nats://…` deployment routes by KV
overlap from events its workers publish on NATS (no ZeroMQ event sockets); stopping NATS loses
no request, the router raises its stale signal and routes on its own past decisions, and once
NATS is back the events flow again and every worker's snapshot re-fills the router's index; a second frontend over the same workers warms from their snapshots and keeps an
index equal to the first's."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.runtime.nats_server import NatsServer
from tests.serving.conftest import start_server, stop_server
from tests.serving.probes import answers, metric, wait
from tokenmill.bench.harness.serve_process import free_port
from tokenmill.runtime.event_plane import kv_subject, parse_event_plane

MOCK = ("--runner", "mock", "--mock-step-time", "0.002,0,0,0")




def _send(base: str, prefix: list[int], count: int) -> list[int]:
    """`count` completions sharing `prefix`, one after another: each one's cached prompt tokens."""
    return [_complete(base, prefix + [100 + i, 200 + i]) for i in range(count)]


def _complete(base: str, prompt: list[int]) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=30, trust_env=False)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2, reply.text
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _index(base: str) -> dict:
    reply = httpx.get(f"{base}/admin/router/index", params={"hashes": "true"}, timeout=30, trust_env=False)
    assert reply.status_code == 200, reply.text
    return reply.json()["decode"]


def test_kv_events_over_nats_survive_nats_going_away(tiny_dense: Path, tmp_path: Path) -> None:
    nats = NatsServer()
    nats.start()
    server = start_server(tiny_dense, tmp_path / "run", *MOCK, "--router", "kv", "--event-plane", nats.url,
                          "--events-stale-after-s", "1", workers=2)
    try:
        base = server.url
        entries = server.registry()
        assert all(e["metadata"]["events_subject"] == kv_subject("tiny", e["worker_id"]) for e in entries)
        assert all(not e["metadata"]["events_address"] for e in entries)  # no ZeroMQ event sockets
        # a shared 64-token prefix (4 blocks): KV routing sends every later request to its holder
        assert _send(base, list(range(10, 74)), 4) == [0, 64, 64, 64]
        wait(lambda: metric(base, "tokenmill_router_index_blocks") >= 4, "the index to fill from NATS")
        applied = metric(base, "tokenmill_router_kv_events_applied_total")

        nats.stop()
        _send(base, list(range(300, 364)), 4)  # served on the last known KV state
        assert metric(base, "tokenmill_router_kv_events_applied_total") == applied  # nothing came through
        time.sleep(1.5)  # past --events-stale-after-s: the next decisions find the events stale
        _send(base, list(range(900, 964)), 12)
        assert metric(base, "tokenmill_router_kv_events_stale") == 1
        assert metric(base, "tokenmill_router_decisions_total", policy="kv-approx") >= 1  # its own decisions

        nats.start()  # the same port: both sides reconnect, the frontend asks for snapshots
        wait(lambda: metric(base, "tokenmill_router_index_blocks") >= 8,
              "the snapshots to bring the outage's blocks into the index", timeout_s=60)
        before = metric(base, "tokenmill_router_kv_events_applied_total")
        assert _send(base, list(range(600, 664)), 4) == [0, 64, 64, 64]  # the hit rate is back
        # each worker's own NATS connection comes back on its own retry clock, maybe after those four
        # requests (their frames dropped, as designed): fresh prompts until one's events arrive
        fresh = iter(range(2000, 10_000))
        wait(lambda: _complete(base, [next(fresh)] + list(range(1, 64))) >= 0
             and metric(base, "tokenmill_router_kv_events_applied_total") > before, "events to flow again")
        assert metric(base, "tokenmill_router_kv_events_stale") == 0
        kv_decisions = metric(base, "tokenmill_router_decisions_total", policy="kv")
        assert _send(base, list(range(700, 764)), 4) == [0, 64, 64, 64]
        assert metric(base, "tokenmill_router_decisions_total", policy="kv") == kv_decisions + 4  # event-built
    finally:
        stop_server(server)
        nats.stop()


@pytest.mark.parametrize("url,message", [("redis://x:1", "--event-plane must be nats://"),
                                         ("nats://", "at least one"), ("nats://h", "host:port")])
def test_event_plane_urls_name_the_flag(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_event_plane(url)
    assert parse_event_plane("nats://a:1,b:2") == ["nats://a:1", "nats://b:2"]
    assert kv_subject("Qwen/Qwen3 8B.gguf", "decode-0") == "tokenmill.kv.Qwen_Qwen3_8B_gguf.decode-0"


def test_a_second_frontend_warms_from_snapshots_and_agrees(tiny_dense: Path, tmp_path: Path) -> None:
    """Another `tokenmill frontend` over the same workers and NATS, started after the traffic:
    its index holds the workers' blocks without a request through it. Then a round-robin client
    over both on a shared-prefix load: each frontend routes to the worker that the other one's
    requests filled, and the two indexes hold the same blocks, block for block."""
    nats = NatsServer()
    nats.start()
    run_dir = tmp_path / "run"
    server = start_server(tiny_dense, run_dir, *MOCK, "--router", "kv", "--event-plane", nats.url, workers=2)
    port = free_port()
    second = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "frontend", "--model", str(tiny_dense),
                               "--served-model-name", "tiny", "--discovery", f"file:{run_dir / 'registry'}",
                               "--event-plane", nats.url, "--router", "kv", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first_url, second_url = server.url, f"http://127.0.0.1:{port}"
        _send(first_url, list(range(10, 74)), 3)
        _send(first_url, list(range(300, 364)), 3)
        wait(lambda: metric(first_url, "tokenmill_router_index_blocks") >= 8, "the first index")
        wait(lambda: answers(second_url) and _index(second_url) == _index(first_url),
             "the second frontend's index to warm up")
        assert metric(second_url, "tokenmill_router_decisions_total") == 0  # warmed with no traffic through it
        bad = httpx.get(f"{second_url}/admin/router/index", params={"hashes": "yes"}, timeout=30, trust_env=False)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "hashes"

        frontends = (first_url, second_url)
        for group in range(4):
            prefix = list(range(1000 + 100 * group, 1064 + 100 * group))
            cached = []
            for turn in range(4):  # round robin: each group's holder was chosen by the other frontend
                cached.append(_complete(frontends[(group + turn) % 2], prefix + [7, turn]))
                wait(lambda: _index(first_url) == _index(second_url), "both frontends to apply the same events")
            assert cached == [0, 64, 64, 64], (group, cached)
        for url in frontends:
            assert metric(url, "tokenmill_router_overlap_blocks_sum") >= 6 * 4  # 6 of its 8 requests hit 4 blocks
        view = _index(first_url)
        assert sum(len(t["hashes"]) for w in view["workers"].values() for t in w["tiers"].values()) >= 24
    finally:
        second.terminate()
        second.wait(timeout=30)
        stop_server(server)
        nats.stop()
