"""POST /v1/completions (legacy text completions), streaming and not."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.engine.request import RequestOutput
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.frontend.body import parse_body
from tokenmill.frontend.formatting import CompletionLogprobsWriter, api_finish_reason, new_request_id, usage_of
from tokenmill.frontend.generation import ServingContext
from tokenmill.frontend.request_args import (check_context_length, check_model, completion_limits,
                                             completion_prompt, reject_unsupported, sampling_params)
from tokenmill.frontend.schema import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from tokenmill.frontend.streaming import serve_generation


class CompletionChunks:
    """Builds both the streamed chunks and the one-shot response of a completion."""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, want_logprobs: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.want_logprobs = want_logprobs
        self.logprobs = CompletionLogprobsWriter(tokenizer)

    def _response(self, choice: CompletionChoice, usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                  usage=usage)

    def opening(self) -> list[CompletionResponse]:
        return []

    def for_delta(self, out: RequestOutput) -> list[CompletionResponse]:
        if not out.new_text and not out.finished and not (self.want_logprobs and out.new_logprobs):
            return []  # text held back (a partial character or a possible stop string)
        logprobs = self.logprobs.add(out.new_logprobs) if self.want_logprobs else None
        choice = CompletionChoice(text=out.new_text, logprobs=logprobs,
                                  finish_reason=api_finish_reason(out.finish_reason) if out.finished else None)
        return [self._response(choice)]

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[],
                                  usage=usage)

    def whole(self, outputs: list[RequestOutput]) -> CompletionResponse:
        logprobs = None
        if self.want_logprobs:
            logprobs = self.logprobs.add([lp for out in outputs for lp in out.new_logprobs])
        last = outputs[-1]
        choice = CompletionChoice(text="".join(out.new_text for out in outputs), logprobs=logprobs,
                                  finish_reason=api_finish_reason(last.finish_reason))
        return self._response(choice, usage_of(last))


def completions_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, ctx.max_body_bytes)
        check_model(body.model, ctx.served_model_name)
        reject_unsupported(body)
        prompt = completion_prompt(body, ctx.backend.tokenizer)
        check_context_length(prompt, ctx.backend.max_model_len, "prompt")
        max_tokens, logprobs = completion_limits(body)
        params = sampling_params(body, max_tokens, logprobs, aliases={})
        request_id = new_request_id("cmpl")
        chunks = CompletionChunks(request_id, ctx.served_model_name, ctx.backend.tokenizer, logprobs is not None)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await serve_generation(ctx, request, request_id, prompt, params, {}, bool(body.stream), chunks,
                                      include_usage, chunks.whole)

    return router
