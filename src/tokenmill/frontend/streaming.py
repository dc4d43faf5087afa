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
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from tokenmill.engine.request import FINISH_ERROR, RequestOutput
from tokenmill.engine.sampling import SamplingParams
from tokenmill.frontend.errors import SERVER_ERROR, APIError, error_body
from tokenmill.frontend.formatting import usage_of
from tokenmill.frontend.generation import ClientGone, ServingContext, TokenStream, cancel_on_disconnect
from tokenmill.frontend.schema import ErrorDetail, Usage

log = logging.getLogger(__name__)
# nginx's "client closed request": nobody reads it, but access logs should say what happened.
CLIENT_CLOSED_REQUEST = 499

DONE_FRAME = "data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ChunkWriter(Protocol):
    """Turns deltas into the endpoint's chunk objects."""

    def opening(self) -> list[BaseModel]: ...

    def for_delta(self, out: RequestOutput) -> list[BaseModel]: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...


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


async def serve_generation(ctx: ServingContext, request: Request, request_id: str, prompt: list[int],
                           params: SamplingParams, aliases: dict[str, str], streamed: bool,
                           writer: ChunkWriter, include_usage: bool,
                           build_response: Callable[[list[RequestOutput]], BaseModel]) -> Response:
    """Run one generation and answer with SSE (`streamed`) or one JSON body."""
    try:
        tokens = await cancel_on_disconnect(request, TokenStream.open(ctx, request_id, prompt, params, aliases))
    except ClientGone:
        ctx.metrics.count_request("disconnected")
        log.info("client left before %s started", request_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if streamed:
        return sse_response(tokens, writer, include_usage)
    try:
        outputs = await cancel_on_disconnect(request, tokens.collect())
    except ClientGone:
        log.info("client left during %s; aborted", request_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if outputs[-1].finish_reason == FINISH_ERROR:
        raise APIError(500, tokens.error_message or "generation failed", SERVER_ERROR, code="internal_error")
    return JSONResponse(build_response(outputs).model_dump(mode="json"))
