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
from tokenmill.frontend.formatting import api_finish_reason, chat_logprobs, new_request_id, usage_of
from tokenmill.frontend.generation import ServingContext
from tokenmill.frontend.request_args import (chat_limits, chat_prompt, check_context_length, check_request,
                                             prompt_chars, sampling_params, tokenized)
from tokenmill.frontend.schema import (AssistantMessage, ChatChoice, ChatChoiceLogprobs, ChatCompletionRequest,
                                       ChatCompletionResponse)
from tokenmill.frontend.streaming import ChunkWriter, SSEResponse, serve_generation


class ChatChunks(ChunkWriter):
    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.envelope("chat.completion.chunk", choices, usage)

    def _logprobs(self, logprobs: list[TokenLogprob]) -> ChatChoiceLogprobs | None:
        return chat_logprobs(self.tokenizer, logprobs) if self.want_logprobs else None

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])]

    def for_delta(self, out: RequestOutput) -> list[dict[str, Any]]:
        if self.skips(out):
            return []
        # OpenAI's final chunk carries `"delta": {}`, not a delta full of nulls
        delta = {"content": out.new_text} if (out.new_text or not out.finished) else {}
        logprobs = self._logprobs(out.new_logprobs)
        choice = {"index": 0, "delta": delta, "logprobs": logprobs.model_dump() if logprobs else None,
                  "finish_reason": api_finish_reason(out.finish_reason) if out.finished else None}
        return [self._chunk([choice])]

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._chunk([], usage)

    def whole(self, outputs: list[RequestOutput]) -> ChatCompletionResponse:
        last = outputs[-1]
        message = AssistantMessage(content="".join(out.new_text for out in outputs))
        choice = ChatChoice(message=message, logprobs=self._logprobs([lp for o in outputs for lp in o.new_logprobs]),
                            finish_reason=api_finish_reason(last.finish_reason))
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                      usage=usage_of(last))


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response | SSEResponse:
    body = await parse_body(request, ChatCompletionRequest, ctx.max_body_bytes)
    check_request(body, ctx.served_model_name)
    prompt = await tokenized(chat_prompt, body, ctx.backend.tokenizer, prompt_chars(body.messages))
    check_context_length(prompt, ctx.backend.max_model_len, "messages")
    max_tokens, logprobs, limit_field = chat_limits(body, len(prompt), ctx.backend.max_model_len)
    aliases = {"prompt": "messages", "max_tokens": limit_field, "logprobs": "top_logprobs"}
    params = sampling_params(body, max_tokens, logprobs, aliases)
    chunks = ChatChunks(new_request_id("chatcmpl"), ctx.served_model_name, ctx.backend.tokenizer,
                        logprobs is not None)
    return await serve_generation(ctx, request, body, prompt, params, aliases, chunks)
