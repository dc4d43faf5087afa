"""Tool calling: tools rendered by the checkpoint's chat template, forced calls enforced by the
grammar, calls parsed (Hermes and Llama-3 JSON) streamed and not, bad tools refused by field."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.api.conftest import MODEL_NAME, Served
from tokenmill.api.tool_formats import FORMATS, CallStream
from tokenmill.api.tools import render_messages, tool_calling

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_tool_choice_returns_a_call_matching_its_schema(client: openai.OpenAI) -> None:
    for seed in range(5):
        result = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, seed=seed, temperature=1.0, max_tokens=96,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls, {"get_weather"})


def test_required_streams_the_same_call_as_it_returns(client: openai.OpenAI) -> None:
    fields = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=3,
                  temperature=1.0, max_tokens=96)
    whole = client.chat.completions.create(**fields).choices[0]
    _check_calls(whole.message.tool_calls, set(SCHEMAS))
    names, arguments, finish = {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **fields):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names[delta.index] = names.get(delta.index, "") + (delta.function.name or "")
            arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
        finish = chunk.choices[0].finish_reason if chunk.choices else finish
    assert finish == "tool_calls"
    assert [(names[i], arguments[i]) for i in sorted(names)] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_auto_and_a_conversation_with_tool_results(client: openai.OpenAI) -> None:
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    result = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=8,
                                            temperature=0.0)
    assert result.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_the_template_shows_the_tools_and_the_calls(server: Served) -> None:
    tokenizer = server.live.backend.tokenizer
    calling = tool_calling(TOOLS, "auto", tokenizer)
    messages, args = render_messages([{"role": "user", "content": "hi"}], calling, tokenizer)
    text = tokenizer.decode(tokenizer.apply_chat_template(messages, **args), skip_special_tokens=False)
    assert "<tools>" in text and '"name": "get_weather"' in text and "<|im_start|>user\nhi" in text
    none = tool_calling(TOOLS, "none", tokenizer)
    assert render_messages([{"role": "user", "content": "hi"}], none, tokenizer) == ([{"role": "user", "content": "hi"}], {})


def test_a_template_without_tools_gets_them_as_a_system_message() -> None:
    plain = SimpleNamespace(chat_template_text="{{ messages }}")
    calling = tool_calling(TOOLS, "auto", plain)  # type: ignore[arg-type]
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
               {"role": "tool", "content": "12:00"}]
    messages, args = render_messages(history, calling, plain)  # type: ignore[arg-type]
    assert args == {}
    assert messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
])
def test_bad_tools_are_400s_naming_the_field(client: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **fields)
    assert err.value.body["param"] == param, err.value.body


HERMES_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n' \
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


def test_the_parsers_read_hermes_and_llama3_calls() -> None:
    content, calls = FORMATS["hermes"].parse(HERMES_TEXT)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert FORMATS["hermes"].parse("<tool_call>\n{not json}\n</tool_call>") == \
        ("<tool_call>\n{not json}\n</tool_call>", [])  # left as text, as vLLM leaves it
    content, calls = FORMATS["llama3_json"].parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": "CET"}
    assert FORMATS["llama3_json"].parse("It is noon.") == ("It is noon.", [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(HERMES_TEXT)), max_size=12),
       st.sampled_from(["hermes", "llama3_json"]))
def test_streamed_parsing_equals_parsing_the_whole_text(cuts: list[int], name: str) -> None:
    text = HERMES_TEXT if name == "hermes" else '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    bounds = sorted({0, *[min(c, len(text)) for c in cuts], len(text)})
    stream, content, calls = CallStream(FORMATS[name]), "", []
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    for i, piece in enumerate(pieces):
        more, done = stream.feed(piece, finished=i == len(pieces) - 1)
        content, calls = content + more, calls + done
    whole_content, whole_calls = FORMATS[name].parse(text)
    assert content.strip() == (whole_content or "")  # a stream keeps the blank lines between calls
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
