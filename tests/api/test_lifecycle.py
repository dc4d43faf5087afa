"""Request lifecycle over a live server: overload (429), client disconnects, deadlines, health."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.api.conftest import MODEL_NAME, Served
from tests.api.helpers import metric, wait_for_metric, wait_until_idle
from tokenmill.api.app import create_app

LONG = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
        "temperature": 0}


def _sse_payloads(lines: list[str]) -> list[Any]:
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_overload_answers_429_with_retry_after_and_accepted_requests_complete(overload_server: Served) -> None:
    body = {"model": MODEL_NAME, "prompt": "Count with me:", "max_tokens": 256, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=overload_server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(20)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}
    accepted = [r for r in responses if r.status_code == 200]
    assert len(accepted) >= 6  # two running plus a queue of four
    assert all(r.json()["usage"]["completion_tokens"] == 256 for r in accepted)
    for refused in (r for r in responses if r.status_code == 429):
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert overload_server.live.backend.in_flight == 0
    assert httpx.post(overload_server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert metric(overload_server.url, "tokenmill_requests_total", status="overloaded") == statuses.count(429)


def test_disconnect_mid_stream_aborts_and_frees_the_kv(server: Served) -> None:
    before = metric(server.url, "tokenmill_requests_total", status="disconnected")
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        frames = 0
        for line in response.iter_lines():
            frames += line.startswith("data: ")
            if frames == 3:
                break
    assert wait_for_metric(server.url, "tokenmill_requests_total", before + 1, status="disconnected") == before + 1
    stats = wait_until_idle(server.live)
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)


def test_disconnect_during_a_non_streamed_request_aborts_it(server: Served) -> None:
    before = metric(server.url, "tokenmill_requests_total", status="disconnected")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.3))
    assert wait_for_metric(server.url, "tokenmill_requests_total", before + 1, status="disconnected") == before + 1
    stats = wait_until_idle(server.live)
    assert (stats.num_running, stats.kv_usage) == (0, 0.0)


def test_deadline_ends_the_request_with_length_and_frees_the_kv(server: Served) -> None:
    # A second app on the same backend whose deadline has always passed already.
    url = server.live.serve(create_app(server.live.backend, MODEL_NAME, request_timeout_s=0.0,
                                       manage_backend=False))
    whole = httpx.post(f"{url}/v1/completions", json=LONG, timeout=60)
    assert whole.status_code == 200
    assert whole.json()["choices"][0]["finish_reason"] == "length"
    assert whole.json()["usage"]["completion_tokens"] < LONG["max_tokens"]
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat, timeout=60) as response:
        chunks = _sse_payloads(list(response.iter_lines()))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert metric(url, "tokenmill_requests_total", status="deadline") == 2
    stats = wait_until_idle(server.live)
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)


def test_health_follows_the_backend(server: Served) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200

    class Stopped:
        model_name, max_model_len, tokenizer = MODEL_NAME, 16, None

        def healthy(self) -> bool:
            return False

        def metrics_snapshot(self) -> dict[str, float]:
            return {}

    app = create_app(Stopped(), MODEL_NAME, manage_backend=False)  # type: ignore[arg-type]
    url = server.live.serve(app)
    response = httpx.get(f"{url}/health")
    assert response.status_code == 503 and response.json()["error"]["code"] == "service_unavailable"


def test_metrics_expose_latency_histograms_tokens_and_worker_gauges(server: Served) -> None:
    usage = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={**LONG, "max_tokens": 8}).json()["usage"]
    assert httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME}).status_code == 400
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert metric(server.url, f"tokenmill_{histogram}_count") >= 1
    assert metric(server.url, "tokenmill_output_tokens_total") >= usage["completion_tokens"] == 8
    assert metric(server.url, "tokenmill_input_tokens_total") >= usage["prompt_tokens"]
    assert metric(server.url, "tokenmill_requests_total", status="success") >= 1
    assert metric(server.url, "tokenmill_requests_total", status="rejected") >= 1
    assert metric(server.url, "tokenmill_workers") == 1.0
    assert metric(server.url, "tokenmill_cost_per_million_tokens") > 0.0
    text = httpx.get(f"{server.url}/metrics").text
    assert 'tokenmill_worker_kv_usage{worker="local"}' in text
