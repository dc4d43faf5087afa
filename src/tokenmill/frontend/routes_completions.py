"""POST /v1/completions (legacy text completions), streaming and not."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tokenmill.engine.request import RequestOutput
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.frontend.body import parse_body
from tokenmill.frontend.formatting import CompletionLogprobsWriter, api_finish_reason, new_request_id, usage_of
from tokenmill.frontend.generation import ServingContext
from tokenmill.frontend.request_args import (check_context_length, check_request, completion_limits,
                                             completion_prompt, prompt_chars, sampling_params, tokenized)
from tokenmill.frontend.schema import CompletionChoice, CompletionRequest, CompletionResponse
from tokenmill.frontend.streaming import ChunkWriter, SSEResponse, serve_generation


class CompletionChunks(ChunkWriter):
    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, want_logprobs: bool) -> None:
        super().__init__(request_id, model, tokenizer, want_logprobs)
        self.logprobs = CompletionLogprobsWriter(tokenizer)

    def for_delta(self, out: RequestOutput) -> list[dict[str, Any]]:
        if self.skips(out):
            return []
        logprobs = self.logprobs.add(out.new_logprobs).model_dump() if self.want_logprobs else None
        choice = {"index": 0, "text": out.new_text, "logprobs": logprobs,
                  "finish_reason": api_finish_reason(out.finish_reason) if out.finished else None}
        return [self.envelope("text_completion", [choice], None)]

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self.envelope("text_completion", [], usage)

    def whole(self, outputs: list[RequestOutput]) -> CompletionResponse:
        logprobs = None
        if self.want_logprobs:
            logprobs = self.logprobs.add([lp for out in outputs for lp in out.new_logprobs])
        last = outputs[-1]
        choice = CompletionChoice(text="".join(out.new_text for out in outputs), logprobs=logprobs,
                                  finish_reason=api_finish_reason(last.finish_reason))
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                  usage=usage_of(last))


async def create_completion(ctx: ServingContext, request: Request) -> Response | SSEResponse:
    body = await parse_body(request, CompletionRequest, ctx.max_body_bytes)
    check_request(body, ctx.served_model_name)
    prompt = await tokenized(completion_prompt, body, ctx.backend.tokenizer, prompt_chars(body.prompt))
    check_context_length(prompt, ctx.backend.max_model_len, "prompt")
    max_tokens, logprobs = completion_limits(body, len(prompt), ctx.backend.max_model_len)
    params = sampling_params(body, max_tokens, logprobs, aliases={})
    chunks = CompletionChunks(new_request_id("cmpl"), ctx.served_model_name, ctx.backend.tokenizer,
                              logprobs is not None)
    return await serve_generation(ctx, request, body, prompt, params, {}, chunks)
