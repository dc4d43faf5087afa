"""POST /v1/chat/completions, streaming and not.

A stream opens with a chunk whose delta is `{"role": "assistant", "content": ""}`,
then one chunk per text delta; the last carries `finish_reason` (and `delta: {}` when
it has no text).
"""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tokenmill.engine.request import RequestOutput
from tokenmill.engine.sampling import TokenLogprob
from tokenmill.frontend.body import parse_body
from tokenmill.frontend.choices import serve
from tokenmill.frontend.formatting import api_finish_reason, chat_logprobs, new_request_id
from tokenmill.frontend.generation import ServingContext
from tokenmill.frontend.request_args import (chat_limits, chat_prompt, check_context_length, check_request,
                                             prompt_chars, sampling_params, tokenized)
from tokenmill.frontend.schema import (AssistantMessage, ChatChoice, ChatChoiceLogprobs, ChatCompletionRequest,
                                       ChatCompletionResponse, Usage)
from tokenmill.frontend.streaming import ChunkWriter, SSEResponse


class ChatChunks(ChunkWriter):
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
        # OpenAI's final chunk carries `"delta": {}`, not a delta full of nulls
        delta = {"content": out.new_text} if (out.new_text or not out.finished) else {}
        logprobs = self._logprobs(out.new_logprobs)
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs.model_dump() if logprobs else None,
                  "finish_reason": api_finish_reason(out.finish_reason) if out.finished else None}
        return [self._chunk([choice])]

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._chunk([], usage)

    def choice(self, outputs: list[RequestOutput]) -> ChatChoice:
        message = AssistantMessage(content="".join(out.new_text for out in outputs))
        return ChatChoice(index=self.index, message=message,
                          logprobs=self._logprobs([lp for o in outputs for lp in o.new_logprobs]),
                          finish_reason=api_finish_reason(outputs[-1].finish_reason))

    def response(self, choices: list[ChatChoice], usage: Usage) -> ChatCompletionResponse:  # type: ignore[override]
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage)


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response | SSEResponse:
    body = await parse_body(request, ChatCompletionRequest, ctx.max_body_bytes)
    check_request(body, ctx.served_model_name)
    prompt = await tokenized(chat_prompt, body, ctx.backend.tokenizer, prompt_chars(body.messages))
    check_context_length(prompt, ctx.backend.max_model_len, "messages")
    max_tokens, logprobs, limit_field = chat_limits(body, len(prompt), ctx.backend.max_model_len)
    aliases = {"prompt": "messages", "max_tokens": limit_field, "logprobs": "top_logprobs"}
    params = sampling_params(body, max_tokens, logprobs, aliases)
    request_id, n = new_request_id("chatcmpl"), body.n or 1

    def writer(index: int) -> ChatChunks:
        return ChatChunks(request_id, ctx.served_model_name, ctx.backend.tokenizer, logprobs is not None, index)

    return await serve(ctx, request, body, [prompt], params, aliases, n, writer)
