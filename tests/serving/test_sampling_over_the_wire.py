"""Penalties and logit_bias cross the request plane intact (msgpack, int keys), and a worker's
refusal of a bias outside the vocabulary is a 400 naming logit_bias."""
from __future__ import annotations

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
