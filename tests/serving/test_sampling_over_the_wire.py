"""Penalties, logit_bias and grammars cross the request plane intact (msgpack, int keys), and a
worker's refusal of a bias outside the vocabulary is a 400 naming logit_bias."""
from __future__ import annotations

import json

import httpx

from tests.serving.conftest import Server


def test_logit_bias_reaches_the_worker_and_bad_ids_are_a_400(two_worker_server: Server) -> None:
    url = two_worker_server.url + "/v1/completions"
    body = {"model": "tiny", "prompt": [11, 12, 13], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0}
    forced = httpx.post(url, json={**body, "logit_bias": {"42": 100}}, timeout=60).json()
    tokens = forced["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and len(set(tokens)) == 1
    plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]["logprobs"]["tokens"]
    assert plain != tokens
    bad = httpx.post(url, json={**body, "logit_bias": {"10000000": 1}}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
    penalised = httpx.post(url, json={**body, "frequency_penalty": 2.0, "presence_penalty": 2.0,
                                      "repetition_penalty": 1.5}, timeout=60)
    assert penalised.status_code == 200 and penalised.json()["usage"]["completion_tokens"] == 6


def test_a_json_schema_is_enforced_by_worker_processes(two_worker_server: Server) -> None:
    schema = {"type": "object", "required": ["ok", "n"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 32, "n": 4,
            "seed": 11, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    result = httpx.post(two_worker_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    for choice in result["choices"]:
        value = json.loads(choice["message"]["content"])
        assert choice["finish_reason"] == "stop" and set(value) == {"ok", "n"} and 0 <= value["n"] <= 9
