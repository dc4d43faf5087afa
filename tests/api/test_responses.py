"""POST /v1/responses (the state-free subset) through the official client, and what it refuses."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.conftest import MODEL_NAME, Served


@pytest.fixture(scope="module")
def client(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_a_response_and_its_stream_say_the_same(client: openai.OpenAI) -> None:
    fields = dict(model=MODEL_NAME, input=[{"role": "user", "content": "hello"}], max_output_tokens=6,
                  temperature=0.0)
    whole = client.responses.create(**fields)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6 and whole.usage.input_tokens > 0
    events = list(client.responses.create(stream=True, **fields))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_instructions_and_string_input_make_the_chat_prompt(client: openai.OpenAI) -> None:
    plain = client.responses.create(model=MODEL_NAME, input="hello", max_output_tokens=2)
    told = client.responses.create(model=MODEL_NAME, input="hello", instructions="be brief", max_output_tokens=2)
    assert told.usage.input_tokens > plain.usage.input_tokens  # the system message is in the prompt


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
])
def test_what_it_cannot_honour_is_a_400_naming_the_field(server: Served, fields: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "input": "hello", **fields}
    response = httpx.post(server.url + "/v1/responses", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_embeddings_are_a_clear_404_naming_what_is_served(server: Served) -> None:
    response = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL_NAME, "input": "x"})
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "/v1/chat/completions" in message and "embedding model" in message
