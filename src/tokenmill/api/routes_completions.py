"""POST /v1/completions (legacy text completions), streaming and not."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tokenmill.api.body import parse_body
from tokenmill.api.choices import serve
from tokenmill.api.formatting import CompletionLogprobsWriter, api_finish_reason, new_request_id
from tokenmill.api.generation import ServingContext
from tokenmill.api.request_args import (
    check_context_length,
    check_request,
    completion_limits,
    completion_prompts,
    prompt_chars,
    sampling_params,
    tokenized,
)
from tokenmill.api.schema import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from tokenmill.api.streaming import ChunkWriter, SSEResponse
from tokenmill.textgen.outputs import RequestOutput
from tokenmill.textgen.tokenizer import Tokenizer


class CompletionChunks(ChunkWriter):
    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, want_logprobs: bool,
                 index: int = 0, seed: int | None = None) -> None:
        super().__init__(request_id, model, tokenizer, want_logprobs, index, seed)
        self.logprobs = CompletionLogprobsWriter(tokenizer)

    def for_delta(self, out: RequestOutput) -> list[dict[str, Any]]:
        if self.skips(out):
            return []
        logprobs = self.logprobs.add(out.new_logprobs).model_dump() if self.want_logprobs else None
        choice = {"index": self.index, "text": out.new_text, "logprobs": logprobs,
                  "finish_reason": api_finish_reason(out.finish_reason) if out.finished else None}
        return [self.envelope("text_completion", [choice], None)]

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self.envelope("text_completion", [], usage)

    def choice(self, outputs: list[RequestOutput]) -> CompletionChoice:
        logprobs = None
        if self.want_logprobs:
            logprobs = self.logprobs.add([lp for out in outputs for lp in out.new_logprobs])
        return CompletionChoice(index=self.index, text="".join(out.new_text for out in outputs), logprobs=logprobs,
                                finish_reason=api_finish_reason(outputs[-1].finish_reason))

    def response(self, choices: list[CompletionChoice], usage: Usage) -> CompletionResponse:  # type: ignore[override]
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, seed=self.seed,
                                  choices=choices, usage=usage)


async def create_completion(ctx: ServingContext, request: Request) -> Response | SSEResponse:
    body = await parse_body(request, CompletionRequest, ctx.max_body_bytes)
    check_request(body, ctx.served_model_name)
    prompts = await tokenized(completion_prompts, body, ctx.backend.tokenizer, prompt_chars(body.prompt))
    for prompt in prompts:
        check_context_length(prompt, ctx.backend.max_model_len, "prompt")
    max_tokens, logprobs = completion_limits(body, max(map(len, prompts)), ctx.backend.max_model_len)
    params = sampling_params(body, max_tokens, logprobs, aliases={})
    request_id, n = new_request_id("cmpl"), body.n or 1

    def writer(index: int) -> CompletionChunks:
        return CompletionChunks(request_id, ctx.served_model_name, ctx.backend.tokenizer, logprobs is not None,
                                index, params.seed)

    return await serve(ctx, request, body, prompts, params, {}, n, writer)
