"""Scale to zero over real processes: `tokenmill serve --planner sla --min-agg 0` drains its idle
pool to no worker, stays healthy, and the next request waits while the planner's cold-start path
starts a worker, then succeeds; a frontend whose pool stays empty answers 503 at its queue
timeout, never hangs."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.serving.probes import answers, metric, wait
from tokenmill.bench.harness.serve_process import HOST, ServeProcess, free_port, launch, stop

FLAGS = ("--runner", "mock", "--mock-profile", "llama-3.1-405b@h100:fp8:tp8", "--kv-cache-blocks", "512",
         "--planner", "sla", "--predictor", "constant", "--planner-interval-s", "1", "--warmup-s", "1",
         "--min-agg", "0", "--scale-to-zero-after-s", "2", "--queue-timeout-s", "300")
BODY = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True, "temperature": 0.0}


def _tokenmill(*argv: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", *argv]


def _get(base: str, path: str) -> Any:
    return httpx.get(base + path, params={"last": "500"}, timeout=10, trust_env=False).json()


def _live_workers(base: str) -> int:
    return sum(1 for w in _get(base, "/admin/workers")["data"] if w["state"] in ("starting", "serving", "draining"))


def _scaled_to_zero(base: str) -> bool:
    decisions = _get(base, "/admin/planner")["data"]
    return any(d["target"].get("agg") == 0 for d in decisions) and _live_workers(base) == 0


def test_an_idle_pool_goes_to_zero_and_the_next_request_starts_a_worker(tiny_dense: Path, tmp_path: Path) -> None:
    port, run_dir = free_port(), tmp_path / "run"
    argv = _tokenmill("serve", "--model", str(tiny_dense), "--served-model-name", "tiny", "--workers", "1",
                      "--host", HOST, "--port", str(port), "--run-dir", str(run_dir), *FLAGS)
    run_dir.mkdir()
    server = ServeProcess(f"http://{HOST}:{port}", run_dir, launch(argv, tmp_path / "serve.log"), 1)
    base = server.url
    try:
        wait(lambda: answers(base), "the API", timeout_s=120)
        wait(lambda: _scaled_to_zero(base), "the idle pool to be drained to no worker", timeout_s=180)
        assert httpx.get(base + "/health", timeout=10, trust_env=False).status_code == 200
        assert metric(base, "tokenmill_requests_waiting_for_worker") == 0
        reply = httpx.post(base + "/v1/completions", json=BODY, timeout=300, trust_env=False)
        decisions = _get(base, "/admin/planner")["data"]
        workers = _get(base, "/admin/workers")["data"]
        waiting_after = metric(base, "tokenmill_requests_waiting_for_worker")
    finally:
        stop(server)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert waiting_after == 0
    [to_zero, *_] = [d for d in decisions if d["target"].get("agg") == 0 and d["actions"]]
    assert to_zero["path"] == "scale-down" and "scaled to zero" in to_zero["reason"], to_zero
    assert "idle for" in to_zero["reason"]
    [cold] = [d for d in decisions if d["path"] == "cold-start"]
    assert cold["actions"] == [{"role": "agg", "delta": 1}] and cold["at_s"] > to_zero["at_s"]
    assert cold["reason"] == "cold start: agg: 1 request(s) waiting and no agg replica (scaled to zero); +1 agg"
    launched, *started = sorted(workers, key=lambda w: w["started_at"])
    assert launched["origin"] == "launch" and launched["state"] == "gone"
    assert started and started[0]["origin"] == "admin" and started[0]["requests_served"] >= 0


def test_a_frontend_whose_pool_stays_empty_answers_503_at_its_queue_timeout(tiny_dense: Path, tmp_path: Path) -> None:
    port, registry = free_port(), tmp_path / "registry"
    registry.mkdir()
    argv = _tokenmill("frontend", "--model", str(tiny_dense), "--served-model-name", "tiny", "--discovery",
                      f"file:{registry}", "--host", HOST, "--port", str(port), "--scale-to-zero",
                      "--queue-timeout-s", "4")
    process = launch(argv, tmp_path / "frontend.log")
    base = f"http://{HOST}:{port}"
    replies: list[httpx.Response] = []
    try:
        wait(lambda: answers(base), "the frontend", timeout_s=120)
        assert httpx.get(base + "/health", timeout=10, trust_env=False).status_code == 200  # empty, by design
        sender = threading.Thread(target=lambda: replies.append(
            httpx.post(base + "/v1/completions", json=BODY, timeout=300, trust_env=False)))
        sender.start()
        wait(lambda: metric(base, "tokenmill_requests_waiting_for_worker") == 1 or not sender.is_alive(),
             "the request to wait for a worker", timeout_s=60)
        waited = sender.is_alive()
        sender.join()
        waiting_after = metric(base, "tokenmill_requests_waiting_for_worker")
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert waited  # it was held, not refused at once
    [reply] = replies
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == "service_unavailable"
    assert "no worker started within 4 s (--queue-timeout-s)" in error["message"]
    assert waiting_after == 0
