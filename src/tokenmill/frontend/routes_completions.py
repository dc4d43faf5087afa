"""POST /v1/completions (legacy text completions), streaming and not."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.engine.request import RequestOutput
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.frontend.body import parse_body
from tokenmill.frontend.formatting import CompletionLogprobsWriter, api_finish_reason, new_request_id, usage_of
from tokenmill.frontend.generation import ServingContext
from tokenmill.frontend.request_args import (check_context_length, check_request, completion_limits,
                                             completion_prompt, sampling_params)
from tokenmill.frontend.schema import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from tokenmill.frontend.streaming import ChunkWriter, serve_generation


class CompletionChunks(ChunkWriter):
    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, want_logprobs: bool) -> None:
        super().__init__(request_id, model, tokenizer, want_logprobs)
        self.logprobs = CompletionLogprobsWriter(tokenizer)

    def _response(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage)

    def for_delta(self, out: RequestOutput) -> list[CompletionResponse]:
        if self.skips(out):
            return []
        logprobs = self.logprobs.add(out.new_logprobs) if self.want_logprobs else None
        choice = CompletionChoice(text=out.new_text, logprobs=logprobs,
                                  finish_reason=api_finish_reason(out.finish_reason) if out.finished else None)
        return [self._response([choice])]

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return self._response([], usage)

    def whole(self, outputs: list[RequestOutput]) -> CompletionResponse:
        logprobs = None
        if self.want_logprobs:
            logprobs = self.logprobs.add([lp for out in outputs for lp in out.new_logprobs])
        last = outputs[-1]
        choice = CompletionChoice(text="".join(out.new_text for out in outputs), logprobs=logprobs,
                                  finish_reason=api_finish_reason(last.finish_reason))
        return self._response([choice], usage_of(last))


def completions_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, ctx.max_body_bytes)
        check_request(body, ctx.served_model_name)
        # off the event loop: a long prompt takes seconds to tokenize, stalling every stream
        prompt = await asyncio.to_thread(completion_prompt, body, ctx.backend.tokenizer)
        check_context_length(prompt, ctx.backend.max_model_len, "prompt")
        max_tokens, logprobs = completion_limits(body)
        params = sampling_params(body, max_tokens, logprobs, aliases={})
        chunks = CompletionChunks(new_request_id("cmpl"), ctx.served_model_name, ctx.backend.tokenizer,
                                  logprobs is not None)
        return await serve_generation(ctx, request, body, prompt, params, {}, chunks)

    return router
