"""Property-based fuzzing of request bodies: any JSON for the known fields, unknown fields, wrong
types. The server answers 2xx or 4xx (never 5xx, never an error event mid-stream) and keeps serving.

Bodies start valid (so generation runs too) and then up to three fields get arbitrary JSON.
Token budgets stay small (a valid `max_tokens` is at most 12) so each example is quick.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.conftest import MODEL_NAME, Served
from tests.api.helpers import wait_until_idle

_SMALL_BUDGET = 12
floats = st.floats()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | floats | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)


def _not_a_big_budget(value: Any) -> bool:
    return not (isinstance(value, int) and not isinstance(value, bool) and value > _SMALL_BUDGET)


shared = {"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 50),
          "seed": st.integers(0, 2**32),
          "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=2),
          "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
          "ignore_eos": st.booleans(), "n": st.just(1), "user": st.text(max_size=5)}
valid_completion = st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "max_tokens": st.integers(1, _SMALL_BUDGET),
     "prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 2047), min_size=1, max_size=8)},
    optional={**shared, "logprobs": st.integers(0, 5), "echo": st.just(False)})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": st.text(max_size=30)})
valid_chat = st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "max_completion_tokens": st.integers(1, _SMALL_BUDGET),
     "messages": st.lists(message, min_size=1, max_size=3)},
    optional={**shared, "logprobs": st.booleans(), "max_tokens": st.integers(1, 50)})
FIELDS = sorted({*shared, "model", "max_tokens", "prompt", "logprobs", "echo", "messages", "max_completion_tokens",
                 "top_logprobs", "presence_penalty", "response_format"})
# A mutated budget stays small, and chat always keeps one, so every example is quick.
mutations = st.dictionaries(st.sampled_from(FIELDS), json_values.filter(_not_a_big_budget), max_size=3).filter(
    lambda m: m.get("max_completion_tokens", 0) is not None)
unknown_fields = st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in FIELDS), json_values,
                                 max_size=2)
requests = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), valid_completion, valid_chat,
                     mutations, unknown_fields)


def _check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
        return
    assert response.status_code == 200
    if response.headers["content-type"].startswith("text/event-stream"):
        frames = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]"
        assert all("error" not in json.loads(frame) for frame in frames[:-1]), response.text
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_fuzzed_bodies_never_get_a_server_error_and_the_server_keeps_serving(server: Served) -> None:
    statuses: Counter[int] = Counter()

    @settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(request=requests)
    def fuzz(request: tuple[str, dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]) -> None:
        path, completion, chat, mutated, unknown = request
        body = {**unknown, **(completion if path == "/v1/completions" else chat), **mutated}
        payload = json.dumps(body)  # NaN and Infinity included: Python's json writes them
        response = httpx.post(server.url + path, content=payload, headers={"content-type": "application/json"},
                              timeout=60)
        statuses[response.status_code] += 1
        _check_answer(response)

    fuzz()
    assert statuses[200] and sum(n for status, n in statuses.items() if 400 <= status < 500)
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3},
                          timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    stats = wait_until_idle(server.live)
    assert (stats.num_running, stats.kv_usage) == (0, 0.0)
