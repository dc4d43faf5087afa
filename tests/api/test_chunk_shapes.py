"""Streamed chunks are plain dicts; the pydantic models in `schema.py` define the same shapes.

Each chunk the writers build must equal, key order included, the model built from the same
values and dumped as JSON, and it must serialize to the same bytes the model would.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from tokenmill.api.formatting import usage_of
from tokenmill.api.routes_chat import ChatChunks
from tokenmill.api.routes_completions import CompletionChunks
from tokenmill.api.schema import (
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from tokenmill.api.streaming import sse_frame
from tokenmill.textgen.outputs import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RequestOutput
from tokenmill.textgen.sampling import TokenLogprob
from tokenmill.textgen.tokenizer import Tokenizer

MODEL = "tiny"
RID = "req-1"
# Token ids of the tiny checkpoint's byte-level vocabulary: "h", "ll", "o", " w", and one byte of
# a multi-byte character (decodes alone to U+FFFD, a non-ASCII string).
H, LL, O_, W, PARTIAL = 74, 285, 81, 263, 130


@pytest.fixture(scope="module")
def tokenizer(tiny_dense: Path) -> Tokenizer:
    return Tokenizer(tiny_dense)


def _ordered(value: Any) -> Any:
    """`value` with every dict as its list of items, so that comparing also compares key order."""
    if isinstance(value, dict):
        return [(key, _ordered(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [_ordered(item) for item in value]
    return value


def _assert_same(chunk: dict[str, Any], model: BaseModel) -> None:
    expected = model.model_dump(mode="json")
    assert _ordered(chunk) == _ordered(expected)
    # the round trip through the model class changes nothing either (no extra, no missing keys)
    assert _ordered(type(model).model_validate(chunk).model_dump(mode="json")) == _ordered(chunk)
    # and on the wire: the frame carries exactly the model's JSON
    assert sse_frame(chunk) == b"data: " + model.model_dump_json().encode() + b"\n\n"


def _out(text: str, token_ids: list[int], finish: str | None = None,
         logprobs: list[TokenLogprob] | None = None, output_tokens: int = 3) -> RequestOutput:
    return RequestOutput(RID, token_ids, text, finish is not None, finish, num_prompt_tokens=5,
                         num_output_tokens=output_tokens, num_cached_tokens=2, new_logprobs=logprobs or [])


def _token(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


LOGPROBS = [TokenLogprob(H, -0.25, [(H, -0.25), (LL, -1.5), (PARTIAL, float("-inf"))]),
            TokenLogprob(PARTIAL, -3.125, [(O_, -0.5), (PARTIAL, -3.125)])]
USAGE = Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8,
              prompt_tokens_details=PromptTokensDetails(cached_tokens=2))

# -- /v1/completions ----------------------------------------------------------------------


def _completions(tokenizer: Tokenizer, want_logprobs: bool = False) -> CompletionChunks:
    return CompletionChunks(RID, MODEL, tokenizer, want_logprobs)


def _completion_chunk(writer: CompletionChunks, choices: list[CompletionChoice],
                      usage: Usage | None = None) -> CompletionResponse:
    return CompletionResponse(id=RID, created=writer.created, model=MODEL, choices=choices, usage=usage)


def test_completion_stream_has_no_opening_chunk(tokenizer: Tokenizer) -> None:
    assert _completions(tokenizer).opening() == []


@pytest.mark.parametrize(("text", "finish", "api_finish"), [
    ("hello", None, None),
    ("o w", FINISH_STOP, "stop"),
    ("", FINISH_LENGTH, "length"),
    ("", FINISH_ABORT, "length"),  # a deadline is reported as "length"
], ids=["delta", "final-with-text", "final-without-text", "final-deadline"])
def test_completion_delta_chunks(tokenizer: Tokenizer, text: str, finish: str | None,
                                 api_finish: str | None) -> None:
    writer = _completions(tokenizer)
    (chunk,) = writer.for_delta(_out(text, [O_, W] if text else [], finish))
    _assert_same(chunk, _completion_chunk(writer, [CompletionChoice(text=text, finish_reason=api_finish)]))


def test_completion_delta_with_logprobs(tokenizer: Tokenizer) -> None:
    writer = _completions(tokenizer, want_logprobs=True)
    texts = [_token(tokenizer, H), _token(tokenizer, PARTIAL)]
    (first,) = writer.for_delta(_out("h", [H], logprobs=LOGPROBS[:1]))
    (second,) = writer.for_delta(_out("", [PARTIAL], FINISH_STOP, logprobs=LOGPROBS[1:]))
    expected_first = CompletionLogprobs(
        tokens=[texts[0]], token_logprobs=[-0.25], text_offset=[0],
        top_logprobs=[{texts[0]: -0.25, _token(tokenizer, LL): -1.5, texts[1]: float("-inf")}])
    expected_second = CompletionLogprobs(  # offsets count on from the previous chunk's text
        tokens=[texts[1]], token_logprobs=[-3.125], text_offset=[len(texts[0])],
        top_logprobs=[{_token(tokenizer, O_): -0.5, texts[1]: -3.125}])
    _assert_same(first, _completion_chunk(writer, [CompletionChoice(text="h", logprobs=expected_first)]))
    _assert_same(second, _completion_chunk(
        writer, [CompletionChoice(text="", logprobs=expected_second, finish_reason="stop")]))


def test_completion_usage_chunk(tokenizer: Tokenizer) -> None:
    writer = _completions(tokenizer)
    last = _out("", [], FINISH_STOP)
    _assert_same(writer.usage_chunk(usage_of(last).model_dump()), _completion_chunk(writer, [], USAGE))


# -- /v1/chat/completions -----------------------------------------------------------------


def _chat(tokenizer: Tokenizer, want_logprobs: bool = False) -> ChatChunks:
    return ChatChunks(RID, MODEL, tokenizer, want_logprobs)


def _chat_chunk(writer: ChatChunks, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=RID, created=writer.created, model=MODEL, choices=choices, usage=usage)


def test_chat_opening_chunk(tokenizer: Tokenizer) -> None:
    writer = _chat(tokenizer)
    (chunk,) = writer.opening()
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    _assert_same(chunk, _chat_chunk(writer, [ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]))


@pytest.mark.parametrize(("text", "finish", "api_finish", "delta"), [
    ("hello", None, None, {"content": "hello"}),
    ("o w", FINISH_STOP, "stop", {"content": "o w"}),
    ("", FINISH_LENGTH, "length", {}),  # OpenAI's last chunk: `"delta": {}`
    ("", FINISH_ABORT, "length", {}),
], ids=["delta", "final-with-text", "final-without-text", "final-deadline"])
def test_chat_delta_chunks(tokenizer: Tokenizer, text: str, finish: str | None, api_finish: str | None,
                           delta: dict[str, str]) -> None:
    writer = _chat(tokenizer)
    (chunk,) = writer.for_delta(_out(text, [O_, W] if text else [], finish))
    assert chunk["choices"][0]["delta"] == delta
    model_delta = ChatDelta(content=text) if delta else ChatDelta()
    _assert_same(chunk, _chat_chunk(writer, [ChatChunkChoice(delta=model_delta, finish_reason=api_finish)]))


def _chat_logprob(tokenizer: Tokenizer, lp: TokenLogprob) -> ChatTokenLogprob:
    text = _token(tokenizer, lp.token_id)
    top = [TopLogprob(token=_token(tokenizer, tid), logprob=value, bytes=list(tokenizer.token_bytes(tid)))
           for tid, value in lp.top]
    return ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(tokenizer.token_bytes(lp.token_id)),
                            top_logprobs=top)


def test_chat_delta_with_logprobs(tokenizer: Tokenizer) -> None:
    writer = _chat(tokenizer, want_logprobs=True)
    (chunk,) = writer.for_delta(_out("h", [H, PARTIAL], logprobs=LOGPROBS))
    content = [_chat_logprob(tokenizer, lp) for lp in LOGPROBS]
    _assert_same(chunk, _chat_chunk(writer, [ChatChunkChoice(delta=ChatDelta(content="h"),
                                                             logprobs=ChatChoiceLogprobs(content=content))]))
    # held-back text still streams the logprobs of its tokens, with an empty content
    (held,) = writer.for_delta(_out("", [PARTIAL], logprobs=LOGPROBS[1:]))
    _assert_same(held, _chat_chunk(writer, [ChatChunkChoice(
        delta=ChatDelta(content=""), logprobs=ChatChoiceLogprobs(content=content[1:]))]))


def test_chat_usage_chunk(tokenizer: Tokenizer) -> None:
    writer = _chat(tokenizer)
    last = _out("", [], FINISH_STOP)
    _assert_same(writer.usage_chunk(usage_of(last).model_dump()), _chat_chunk(writer, [], USAGE))


# -- both -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [_completions, _chat], ids=["completions", "chat"])
def test_a_delta_with_nothing_to_show_makes_no_chunk(tokenizer: Tokenizer, make: Any) -> None:
    assert make(tokenizer).for_delta(_out("", [PARTIAL])) == []
    # with logprobs off, logprobs on the delta don't make it worth a chunk either
    assert make(tokenizer).for_delta(_out("", [PARTIAL], logprobs=LOGPROBS[1:])) == []


def test_sse_frame_is_compact_json_with_utf8_kept(tokenizer: Tokenizer) -> None:
    text = "héllo wörld ✓ 你好 \U0001f600"
    (chunk,) = _chat(tokenizer).for_delta(_out(text, [O_]))
    frame = sse_frame(chunk)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    body = frame[len(b"data: "):-2]
    assert b"\n" not in body
    assert body == json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert text.encode("utf-8") in body and b"\\u" not in body
    assert json.loads(body.decode("utf-8")) == chunk
