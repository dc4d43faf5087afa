"""POST /v1/chat/completions, streaming and not.

A stream opens with a chunk whose delta is `{"role": "assistant", "content": ""}`,
then one chunk per text delta; the last carries `finish_reason` (and `delta: {}` when
it has no text).
"""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tokenmill.api.body import parse_body
from tokenmill.api.choices import serve
from tokenmill.api.formatting import api_finish_reason, chat_logprobs, new_request_id
from tokenmill.api.generation import ServingContext
from tokenmill.api.request_args import (
    chat_limits,
    chat_prompt,
    check_context_length,
    check_request,
    prompt_chars,
    sampling_params,
    tokenized,
)
from tokenmill.api.schema import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ToolCall,
    Usage,
)
from tokenmill.api.streaming import ChunkWriter, SSEResponse
from tokenmill.api.tool_formats import CallStream
from tokenmill.api.tools import ToolCalling, tool_calling
from tokenmill.textgen.outputs import RequestOutput
from tokenmill.textgen.sampling import TokenLogprob


class ChatChunks(ChunkWriter):
    """With tools, the text goes through the call format's parser: calls leave as `tool_calls`."""

    def __init__(self, *args: Any, calling: ToolCalling | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = CallStream(calling.format) if calling is not None and calling.shown else None

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.envelope("chat.completion.chunk", choices, usage)

    def _logprobs(self, logprobs: list[TokenLogprob]) -> ChatChoiceLogprobs | None:
        return chat_logprobs(self.tokenizer, logprobs) if self.want_logprobs else None

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk([{"index": self.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])]

    def for_delta(self, out: RequestOutput) -> list[dict[str, Any]]:
        if self.skips(out):
            return []
        text, calls = (out.new_text, []) if self.calls is None else self.calls.feed(out.new_text, out.finished)
        if not (text or calls or out.finished or (self.want_logprobs and out.new_logprobs)):
            return []  # the parser holds this text back: it may open a call
        # OpenAI's final chunk carries `"delta": {}`, not a delta full of nulls
        delta: dict[str, Any] = {"content": text} if (text or not (out.finished or calls)) else {}
        if calls:
            first = len(self.calls.calls) - len(calls)  # type: ignore[union-attr]
            delta["tool_calls"] = [{"index": first + i, **call} for i, call in enumerate(calls)]
        logprobs = self._logprobs(out.new_logprobs)
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs.model_dump() if logprobs else None,
                  "finish_reason": self._finish_reason(out) if out.finished else None}
        return [self._chunk([choice])]

    def _finish_reason(self, out: RequestOutput) -> str | None:
        reason = api_finish_reason(out.finish_reason)
        return "tool_calls" if self.calls is not None and self.calls.calls and reason == "stop" else reason

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._chunk([], usage)

    def choice(self, outputs: list[RequestOutput]) -> ChatChoice:
        text: str | None = "".join(out.new_text for out in outputs)
        calls: list[dict[str, Any]] = []
        if self.calls is not None:
            text, calls = self.calls.format.parse(text or "")
            self.calls.calls = calls
        message = AssistantMessage(content=text, tool_calls=[ToolCall(**call) for call in calls])
        return ChatChoice(index=self.index, message=message,
                          logprobs=self._logprobs([lp for o in outputs for lp in o.new_logprobs]),
                          finish_reason=self._finish_reason(outputs[-1]))

    def response(self, choices: list[ChatChoice], usage: Usage) -> ChatCompletionResponse:  # type: ignore[override]
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, seed=self.seed,
                                      choices=choices, usage=usage)


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response | SSEResponse:
    body = await parse_body(request, ChatCompletionRequest, ctx.max_body_bytes)
    check_request(body, ctx.served_model_name)
    calling = tool_calling(body.tools, body.tool_choice, ctx.backend.tokenizer, ctx.tool_call_parser)
    prompt = await tokenized(lambda b, tok: chat_prompt(b, tok, calling), body, ctx.backend.tokenizer,
                             prompt_chars(body.messages))
    check_context_length(prompt, ctx.backend.max_model_len, "messages")
    max_tokens, logprobs, limit_field = chat_limits(body, len(prompt), ctx.backend.max_model_len)
    aliases = {"prompt": "messages", "max_tokens": limit_field, "logprobs": "top_logprobs"}
    grammar = calling.grammar() if calling is not None else None
    if grammar is not None:
        aliases["response_format"] = "tool_choice"
    params = sampling_params(body, max_tokens, logprobs, aliases, grammar)
    request_id, n = new_request_id("chatcmpl"), body.n or 1

    def writer(index: int) -> ChatChunks:
        return ChatChunks(request_id, ctx.served_model_name, ctx.backend.tokenizer, logprobs is not None, index,
                          params.seed, calling=calling)

    return await serve(ctx, request, body, [prompt], params, aliases, n, writer)
