"""POST /v1/responses, the state-free subset of OpenAI's Responses API, streaming and not.

`input` is a string or a list of messages (content a string or `input_text` / `output_text`
parts), `instructions` becomes a leading system message, `max_output_tokens` bounds the
output; the prompt is rendered with the model's chat template as for chat completions.
Nothing is stored: `previous_response_id`, `conversation`, `background` and `tools` are
refused with a 400 naming them (`store` is accepted and has no effect). A stream sends the
Responses events in order: created, in_progress, output_item.added, content_part.added,
output_text.delta…, output_text.done, content_part.done, output_item.done, completed.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from tokenmill.api.body import parse_body
from tokenmill.api.errors import SERVER_ERROR, APIError, invalid_param
from tokenmill.api.formatting import api_finish_reason
from tokenmill.api.generation import CancelOnDisconnect, ServingContext, TokenStream
from tokenmill.api.request_args import (
    chat_prompt,
    check_context_length,
    check_model,
    check_room,
    prompt_chars,
    sampling_params,
    tokenized,
)
from tokenmill.api.schema import ChatCompletionRequest, ChatMessage, _Request
from tokenmill.api.streaming import CLIENT_CLOSED_REQUEST, SSEResponse
from tokenmill.textgen.outputs import FINISH_ERROR, FINISH_LENGTH, RequestOutput

_STATEFUL = ("previous_response_id", "conversation", "background", "tools")


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]


class ResponsesRequest(_Request):
    model: str
    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    tools: list[Any] | None = None


def _as_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The same conversation as a chat completion request (for its template and limits)."""
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        text = item.content if isinstance(item.content, str) else "".join(part.text for part in item.content)
        messages.append(ChatMessage(role=item.role, content=text))
    return ChatCompletionRequest(model=body.model, messages=messages, temperature=body.temperature,
                                 top_p=body.top_p)


def _check(body: ResponsesRequest, served_model: str) -> None:
    check_model(body.model, served_model)
    for field in _STATEFUL:
        if getattr(body, field) not in (None, False, []):
            raise invalid_param(field, f"{field} is not supported: this server keeps no response state")


async def create_response(ctx: ServingContext, request: Request) -> Response | SSEResponse:
    body = await parse_body(request, ResponsesRequest, ctx.max_body_bytes)
    _check(body, ctx.served_model_name)
    chat = _as_chat(body)
    prompt = await tokenized(chat_prompt, chat, ctx.backend.tokenizer, prompt_chars(chat.messages))
    check_context_length(prompt, ctx.backend.max_model_len, "input")
    room = ctx.backend.max_model_len - len(prompt)
    if body.max_output_tokens is not None:
        check_room(len(prompt), body.max_output_tokens, ctx.backend.max_model_len, "max_output_tokens", "input")
    max_tokens = room if body.max_output_tokens is None else body.max_output_tokens
    params = sampling_params(chat, max_tokens, None, {"prompt": "input", "max_tokens": "max_output_tokens"})
    writer = ResponseWriter(ctx.served_model_name, body)
    async with CancelOnDisconnect(request.receive) as guard:
        tokens = await TokenStream.open(ctx, writer.id, prompt, params, {"prompt": "input"})
        request.state.tokens = tokens
        if body.stream:
            return SSEResponse(writer.events(tokens))
        outputs = await tokens.collect()
    if guard.gone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if outputs[-1].finish_reason == FINISH_ERROR:
        raise APIError(500, tokens.error_message or "generation failed", SERVER_ERROR, code="internal_error")
    text = "".join(out.new_text for out in outputs)
    return Response(orjson.dumps(writer.response(text, outputs[-1])), media_type="application/json")


class ResponseWriter:
    """One response's objects: the whole body and, streaming, its typed events."""

    def __init__(self, model: str, body: ResponsesRequest) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.body = body
        self.created_at = int(time.time())
        self.sequence = 0

    def response(self, text: str | None, last: RequestOutput | None) -> dict[str, Any]:
        """The response object; `last` None: still in progress (no output yet)."""
        done = last is not None
        cut = done and api_finish_reason(last.finish_reason) == FINISH_LENGTH
        output = [self.message(text or "", "incomplete" if cut else "completed")] if done else []
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": ("incomplete" if cut else "completed") if done else "in_progress",
                "model": self.model, "output": output, "instructions": self.body.instructions,
                "max_output_tokens": self.body.max_output_tokens, "temperature": self.body.temperature,
                "top_p": self.body.top_p, "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "error": None, "tools": [], "tool_choice": "auto", "parallel_tool_calls": False,
                "metadata": {}, "usage": _usage(last) if done else None}

    def message(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    async def events(self, tokens: TokenStream) -> AsyncIterator[bytes]:
        yield self.event("response.created", response=self.response(None, None))
        yield self.event("response.in_progress", response=self.response(None, None))
        yield self.event("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": []}
        yield self.event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                         part=part)
        text = ""
        async for out in tokens.deltas():
            if out.finish_reason == FINISH_ERROR:
                yield self.event("error", message=tokens.error_message or "generation failed", code="internal_error")
                return
            if out.new_text:
                text += out.new_text
                yield self.event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                 content_index=0, delta=out.new_text)
        final = self.response(text, tokens.last)
        yield self.event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                         text=text)
        yield self.event("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0,
                         part={**part, "text": text})
        yield self.event("response.output_item.done", output_index=0, item=final["output"][0])
        yield self.event("response.completed" if final["status"] == "completed" else "response.incomplete",
                         response=final)


def _usage(last: RequestOutput) -> dict[str, Any]:
    return {"input_tokens": last.num_prompt_tokens, "output_tokens": last.num_output_tokens,
            "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
            "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}
