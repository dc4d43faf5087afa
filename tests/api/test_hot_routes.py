"""HotRoutes: the generation endpoints bypass FastAPI but keep its contract (POST only, OpenAI
error objects); every other route still goes through FastAPI."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.api.conftest import MODEL_NAME, Served
from tests.api.helpers import metric, wait_for_metric, wait_until_idle

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HOT = [COMPLETIONS, CHAT]
BODIES = {COMPLETIONS: {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "temperature": 0},
          CHAT: {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                 "temperature": 0}}


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"]
    assert list(body["error"]) == ["message", "type", "param", "code"] and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("path", HOT)
@pytest.mark.parametrize("method", ["GET", "PUT", "PATCH", "DELETE", "OPTIONS"])
def test_any_method_but_post_is_a_405_openai_error(server: Served, method: str, path: str) -> None:
    response = httpx.request(method, server.url + path, json=BODIES[path] if method != "GET" else None)
    assert response.status_code == 405 and response.headers.get("allow") == "POST"
    error = _error(response)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "method_not_allowed")
    assert path in error["message"] and method in error["message"]


@pytest.mark.parametrize("path", HOT)
def test_head_is_a_405_without_a_body(server: Served, path: str) -> None:
    response = httpx.head(server.url + path)
    assert response.status_code == 405 and response.content == b""


@pytest.mark.parametrize("path", HOT)
def test_post_is_served_also_with_a_query_string(server: Served, path: str) -> None:
    response = httpx.post(f"{server.url}{path}?trace=1", json=BODIES[path], timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == MODEL_NAME and body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", HOT)
def test_streaming_through_the_hot_route(server: Served, path: str) -> None:
    with httpx.stream("POST", server.url + path, json={**BODIES[path], "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("usage" not in chunk for chunk in chunks)  # no include_usage: no usage key
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path", HOT)
def test_malformed_json_is_a_400_without_param(server: Served, path: str) -> None:
    response = httpx.post(server.url + path, content=b'{"model": ', headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = _error(response)
    assert (error["type"], error["param"]) == ("invalid_request_error", None)
    assert "not valid JSON" in error["message"]


@pytest.mark.parametrize("path", HOT)
def test_a_wrongly_typed_field_is_a_400_naming_it(server: Served, path: str) -> None:
    response = httpx.post(server.url + path, json={**BODIES[path], "max_tokens": "5"})
    assert response.status_code == 400
    error = _error(response)
    assert (error["type"], error["param"]) == ("invalid_request_error", "max_tokens")


@pytest.mark.parametrize("path", HOT)
def test_unknown_model_is_a_404_and_counted_as_rejected(server: Served, path: str) -> None:
    before = metric(server.url, "tokenmill_requests_total", status="rejected")
    response = httpx.post(server.url + path, json={**BODIES[path], "model": "gpt-9"})
    assert response.status_code == 404
    error = _error(response)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert metric(server.url, "tokenmill_requests_total", status="rejected") == before + 1


def test_other_routes_still_go_through_fastapi(server: Served) -> None:
    models = httpx.get(f"{server.url}/v1/models")
    assert models.status_code == 200
    assert [card["id"] for card in models.json()["data"]] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/v1/models/{MODEL_NAME}").json()["id"] == MODEL_NAME
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert "tokenmill_requests_total" in httpx.get(f"{server.url}/metrics").text
    # FastAPI's own errors keep the OpenAI shape
    wrong_method = httpx.post(f"{server.url}/v1/models", json={})
    assert wrong_method.status_code == 405 and _error(wrong_method)["code"] == "method_not_allowed"
    missing = httpx.post(f"{server.url}/v1/completions/extra", json=BODIES[COMPLETIONS])
    assert missing.status_code == 404 and _error(missing)["code"] == "not_found"


def test_chat_client_leaving_after_the_first_chunk_aborts_the_generation(server: Served) -> None:
    """The existing disconnect tests (test_lifecycle.py) leave a completions stream after three
    frames; this leaves a chat stream right after its opening chunk."""
    before = metric(server.url, "tokenmill_requests_total", status="disconnected")
    body = {**BODIES[CHAT], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=60) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    assert json.loads(first[len("data: "):])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert wait_for_metric(server.url, "tokenmill_requests_total", before + 1, status="disconnected") == before + 1
    stats = wait_until_idle(server.live)
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)
