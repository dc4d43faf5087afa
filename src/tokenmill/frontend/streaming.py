"""Server-sent events: `data: <json>\\n\\n` frames ending with `data: [DONE]\\n\\n`.

With `stream_options.include_usage`, every chunk carries `"usage": null` and one last
chunk with empty `choices` carries the usage (as OpenAI does); without it, chunks
have no `usage` key. A generation that fails mid-stream sends
`data: {"error": {...}}` and then `data: [DONE]`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from tokenmill.engine.request import FINISH_ERROR, RequestOutput
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.frontend.errors import SERVER_ERROR, APIError, error_body
from tokenmill.frontend.formatting import usage_of
from tokenmill.frontend.generation import ClientGone, ServingContext, TokenStream, cancel_on_disconnect
from tokenmill.frontend.schema import ErrorDetail, SamplingFields, Usage

log = logging.getLogger(__name__)
# nginx's "client closed request": nobody reads it, but access logs should say what happened.
CLIENT_CLOSED_REQUEST = 499

DONE_FRAME = "data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ChunkWriter:
    """One request's response objects: the streamed chunks and the one-shot body (per endpoint)."""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, want_logprobs: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs

    def opening(self) -> list[BaseModel]:
        return []

    def for_delta(self, out: RequestOutput) -> list[BaseModel]:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> BaseModel:
        raise NotImplementedError

    def whole(self, outputs: list[RequestOutput]) -> BaseModel:
        raise NotImplementedError

    def skips(self, out: RequestOutput) -> bool:
        """A delta with nothing to show: its text is held back (a partial character, a possible stop string)."""
        return not out.new_text and not out.finished and not (self.want_logprobs and out.new_logprobs)


def sse_frame(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _chunk_frame(chunk: BaseModel, include_usage: bool) -> str:
    payload = chunk.model_dump(mode="json")
    if not include_usage:
        payload.pop("usage", None)
    return sse_frame(payload)


def error_frame(message: str) -> str:
    return sse_frame(error_body(ErrorDetail(message=message, type=SERVER_ERROR, code="internal_error")))


async def sse_events(stream: TokenStream, writer: ChunkWriter, include_usage: bool) -> AsyncIterator[str]:
    for chunk in writer.opening():
        yield _chunk_frame(chunk, include_usage)
    failed = False
    async with contextlib.aclosing(stream.deltas()) as deltas:  # closing aborts the generation at once
        async for out in deltas:
            if out.finish_reason == FINISH_ERROR:
                failed = True
                yield error_frame(stream.error_message or "generation failed")
                continue
            for chunk in writer.for_delta(out):
                yield _chunk_frame(chunk, include_usage)
    if include_usage and not failed:
        yield _chunk_frame(writer.usage_chunk(usage_of(stream.last)), include_usage=True)
    yield DONE_FRAME


def sse_response(stream: TokenStream, writer: ChunkWriter, include_usage: bool) -> StreamingResponse:
    return StreamingResponse(sse_events(stream, writer, include_usage), media_type="text/event-stream",
                             headers=_SSE_HEADERS)


async def serve_generation(ctx: ServingContext, request: Request, body: SamplingFields, prompt: list[int],
                           params: SamplingParams, aliases: dict[str, str], writer: ChunkWriter) -> Response:
    """Run one generation and answer with SSE (`body.stream`) or one JSON body."""
    request_id = writer.request_id
    try:
        tokens = await cancel_on_disconnect(request, TokenStream.open(ctx, request_id, prompt, params, aliases))
    except ClientGone:
        ctx.metrics.count_request("disconnected")
        log.info("client left before %s started", request_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if body.stream:
        return sse_response(tokens, writer, bool(body.stream_options and body.stream_options.include_usage))
    try:
        outputs = await cancel_on_disconnect(request, tokens.collect())
    except ClientGone:
        log.info("client left during %s; aborted", request_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if outputs[-1].finish_reason == FINISH_ERROR:
        raise APIError(500, tokens.error_message or "generation failed", SERVER_ERROR, code="internal_error")
    return JSONResponse(writer.whole(outputs).model_dump(mode="json"))
