"""response_format json_object / json_schema through the official client: the grammar engine makes
every output parse and validate, whatever the seed, streamed or not; bad schemas are 400s."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.api.conftest import MODEL_NAME, Served
from tokenmill.api.structured import response_format_grammar
from tokenmill.textgen.sampling import SamplingParams

# Bounded on purpose: a random-weight model must be able to finish the object within max_tokens.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "count", "ok", "tag"],
          "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "tag": {"type": "string", "maxLength": 6}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(scope="module")
def client(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_output_validates_for_50_seeds(client: openai.OpenAI) -> None:
    for seed in range(50):
        result = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=JSON_SCHEMA,
                                                seed=seed, temperature=1.0, max_tokens=64)
        choice = result.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_concatenates_to_the_unstreamed_body(client: openai.OpenAI) -> None:
    fields = dict(model=MODEL_NAME, messages=MESSAGES, response_format=JSON_SCHEMA, seed=7, temperature=1.0,
                  max_tokens=64)
    whole = client.chat.completions.create(**fields).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(stream=True, **fields) if chunk.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_json_object_and_completions_with_several_choices(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=48, temperature=0.0,
                                          response_format={"type": "json_object"})
    if chat.choices[0].finish_reason == "stop":  # greedy may not close an unbounded object in 48 tokens
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    else:
        assert chat.choices[0].message.content.startswith("{")
    result = client.completions.create(model=MODEL_NAME, prompt="JSON:", max_tokens=64, n=3, seed=1,
                                       extra_body={"response_format": JSON_SCHEMA})
    assert len(result.choices) == 3
    for choice in result.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)


@pytest.mark.parametrize(("response_format", "param"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "no"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "xml"}, "response_format.type"),
])
def test_bad_response_formats_are_400s_naming_the_field(client: openai.OpenAI, response_format: dict,
                                                        param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=response_format)
    assert err.value.body["param"] == param, err.value.body


def test_the_engine_refuses_a_broken_grammar_and_replays_a_migrated_output(server: Served) -> None:
    engine = server.live.engine.engine
    with pytest.raises(ValueError, match="^response_format"):
        engine.grammars.matcher("start: %json{")
    grammar = response_format_grammar(JSON_SCHEMA)
    tokenizer = engine.tokenizer
    done = tokenizer.encode('{"city":"Nice"', add_special_tokens=False)
    matcher = engine.grammars.matcher(grammar, done)  # a migrated request's output so far
    assert not matcher.is_stopped() and not matcher.is_error()
    with pytest.raises(ValueError, match="does not match"):
        engine.grammars.matcher(grammar, tokenizer.encode("[1]", add_special_tokens=False))
    assert SamplingParams(grammar=grammar).grammar == grammar
