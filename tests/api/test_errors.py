"""Client mistakes give OpenAI error objects with the right status and the offending field."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.api.conftest import MODEL_NAME, Served

USER = [{"role": "user", "content": "hi"}]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, **fields}


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    return body["error"]


BAD_BODIES = [
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2}, "model"),
    (COMPLETIONS, {"model": MODEL_NAME}, "prompt"),
    (COMPLETIONS, _completion(max_tokens="5"), "max_tokens"),
    (COMPLETIONS, _completion(max_tokens=0), "max_tokens"),
    (COMPLETIONS, _completion(temperature=-1), "temperature"),
    (COMPLETIONS, _completion(temperature="hot"), "temperature"),
    (COMPLETIONS, _completion(temperature=2.5), "temperature"),   # OpenAI's range is [0, 2]
    (COMPLETIONS, _completion(top_p=0), "top_p"),
    (COMPLETIONS, _completion(top_k=-2), "top_k"),
    (COMPLETIONS, _completion(seed=2**64), "seed"),
    (COMPLETIONS, _completion(stop=[""]), "stop"),
    (COMPLETIONS, _completion(stop=[1, 2]), "stop[0]"),
    (COMPLETIONS, _completion(stream="yes"), "stream"),
    (COMPLETIONS, _completion(logprobs=50), "logprobs"),
    (COMPLETIONS, _completion(n=0), "n"),
    (CHAT, _chat(n=17), "n"),
    (COMPLETIONS, _completion(prompt=["a"] * 9, n=2), "prompt"),   # 18 choices: over the cap of 16
    (COMPLETIONS, _completion(echo=True), "echo"),
    (COMPLETIONS, _completion(presence_penalty=2.5), "presence_penalty"),   # OpenAI's range is [-2, 2]
    (COMPLETIONS, _completion(frequency_penalty=-3), "frequency_penalty"),
    (CHAT, _chat(repetition_penalty=0), "repetition_penalty"),
    (COMPLETIONS, _completion(logit_bias={"not-a-token": 1}), "logit_bias"),
    (COMPLETIONS, _completion(logit_bias={"5": 101}), "logit_bias"),
    (CHAT, _chat(logit_bias={"999999": 1}), "logit_bias"),                    # beyond the vocabulary
    (COMPLETIONS, _completion(prompt=["a", ""]), "prompt"),
    (COMPLETIONS, _completion(prompt=""), "prompt"),
    (COMPLETIONS, _completion(prompt=[1, 2, 10**6]), "prompt"),
    (COMPLETIONS, _completion(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (CHAT, _chat(messages=[]), "messages"),
    (CHAT, _chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (CHAT, _chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0].type"),
    (CHAT, _chat(max_completion_tokens=0), "max_completion_tokens"),
    (CHAT, _chat(temperature=2.01), "temperature"),
    (CHAT, _chat(messages=[{"role": "user"}]), "messages[0].content"),
    (CHAT, _chat(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": None}]),
     "messages[1].content"),
    (CHAT, _chat(max_tokens=-1), "max_tokens"),
    (CHAT, _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (CHAT, _chat(top_logprobs=2), "top_logprobs"),
    (CHAT, _chat(logprobs=1), "logprobs"),
    (CHAT, _chat(tools=[{"type": "function"}]), "tools[0].function"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"), "tool_choice"),
    (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}}),
     "response_format.json_schema.schema"),
    (COMPLETIONS, _completion(response_format={"type": "yaml"}), "response_format.type"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES, ids=[p for _, _, p in BAD_BODIES])
def test_bad_values_are_400_naming_the_field(server: Served, path: str, body: dict[str, Any], param: str) -> None:
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{", b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"null"])
def test_malformed_or_non_object_json_is_400(server: Served, raw: bytes) -> None:
    response = httpx.post(server.url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert _error(response)["param"] is None


@pytest.mark.parametrize(("path", "body"), [(COMPLETIONS, _completion(model="gpt-9")), (CHAT, _chat(model="x"))])
def test_unknown_model_is_404(server: Served, path: str, body: dict[str, Any]) -> None:
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == 404
    error = _error(response)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert httpx.get(f"{server.url}/v1/models/gpt-9").status_code == 404
    assert httpx.get(f"{server.url}/v1/models/{MODEL_NAME}").json()["id"] == MODEL_NAME


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, _completion(prompt="a " * 3000), "prompt"),
    (COMPLETIONS, _completion(prompt=[5] * 2048), "prompt"),
    (CHAT, _chat(messages=[{"role": "user", "content": "a " * 3000}]), "messages"),
])
def test_prompt_over_the_context_length_is_400(server: Served, path: str, body: dict[str, Any], param: str) -> None:
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == 400
    error = _error(response)
    assert (error["param"], error["code"]) == (param, "context_length_exceeded")


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, _completion(max_tokens=10**6), "max_tokens"),
    (CHAT, _chat(max_tokens=10**6), "max_tokens"),
    (CHAT, _chat(max_tokens=None, max_completion_tokens=10**6), "max_completion_tokens"),
])
def test_a_limit_the_context_cannot_hold_is_400_not_a_silent_clamp(server: Served, path: str, body: dict[str, Any],
                                                                    param: str) -> None:
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert (error["param"], error["code"]) == (param, "context_length_exceeded")
    assert "maximum context length" in error["message"] and str(10**6) in error["message"]


def test_limits_that_fit_and_an_assistant_turn_without_content_are_served(server: Served) -> None:
    fits = httpx.post(server.url + COMPLETIONS, json=_completion(max_tokens=3, temperature=2.0, ignore_eos=True))
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 3
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "again"}]
    assert httpx.post(server.url + CHAT, json=_chat(messages=turns)).status_code == 200


def test_body_too_large_is_413(server: Served) -> None:
    body = json.dumps(_completion(prompt="a" * (5 * 1024 * 1024)))
    response = httpx.post(server.url + COMPLETIONS, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert _error(response)["code"] == "request_too_large"


def test_unknown_route_and_wrong_method_are_json_errors(server: Served) -> None:
    missing = httpx.get(f"{server.url}/v1/nothing-here")
    assert missing.status_code == 404 and _error(missing)["code"] == "not_found"
    wrong_method = httpx.get(server.url + COMPLETIONS)
    assert wrong_method.status_code == 405 and _error(wrong_method)["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored(server: Served) -> None:
    response = httpx.post(server.url + CHAT, json=_chat(some_future_field={"x": 1}, temperature=0))
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1
