"""Server-sent events: `data: <json>\\n\\n` frames ending with `data: [DONE]\\n\\n`.

With `stream_options.include_usage`, every chunk carries `"usage": null` and one last
chunk with empty `choices` carries the usage (as OpenAI does); without it, chunks
have no `usage` key. With `continuous_usage_stats` too (vLLM's extension), every chunk
carries the usage so far instead of null. A generation that fails mid-stream sends
`data: {"error": {...}}` and then `data: [DONE]`.

Chunks are plain dicts serialized with orjson (the pydantic models in `schema.py` define
the same shapes, and the tests hold the two together): a stream of N tokens would
otherwise build and validate N response models. `SSEResponse` writes the frames itself,
with one watcher task for a client hang-up, instead of Starlette's per-stream task group.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from tokenmill.api.errors import SERVER_ERROR, APIError, error_body
from tokenmill.api.formatting import usage_of
from tokenmill.api.generation import CancelOnDisconnect, ServingContext, TokenStream
from tokenmill.api.schema import ErrorDetail, SamplingFields, Usage
from tokenmill.textgen.outputs import FINISH_ERROR, RequestOutput
from tokenmill.textgen.sampling import SamplingParams
from tokenmill.textgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)
# nginx's "client closed request": nobody reads it, but access logs should say what happened.
CLIENT_CLOSED_REQUEST = 499

DONE_FRAME = b"data: [DONE]\n\n"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


class ChunkWriter:
    """One choice's response objects: the streamed chunks (dicts) and the one-shot body (per endpoint).
    A request with several choices (n > 1, several prompts) has a writer per choice, `index` apart."""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, want_logprobs: bool,
                 index: int = 0, seed: int | None = None) -> None:
        self.request_id = request_id
        self.seed = seed  # the request's sampling seed, returned so that the answer can be replayed
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.index = index

    def opening(self) -> list[dict[str, Any]]:
        return []

    def for_delta(self, out: RequestOutput) -> list[dict[str, Any]]:
        raise NotImplementedError

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def choice(self, outputs: list[RequestOutput]) -> BaseModel:
        """This choice of the one-shot body."""
        raise NotImplementedError

    def response(self, choices: list[BaseModel], usage: Usage) -> BaseModel:
        raise NotImplementedError

    def whole(self, outputs: list[RequestOutput]) -> BaseModel:
        return self.response([self.choice(outputs)], usage_of(outputs[-1]))

    def envelope(self, kind: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """The fields every chunk opens with, in OpenAI's order (`schema._Envelope`)."""
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None, "seed": self.seed, "choices": choices, "usage": usage}

    def skips(self, out: RequestOutput) -> bool:
        """A delta with nothing to show: its text is held back (a partial character, a possible stop string)."""
        return not out.new_text and not out.finished and not (self.want_logprobs and out.new_logprobs)


def sse_frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chunk_frame(chunk: dict[str, Any], include_usage: bool) -> bytes:
    if not include_usage:
        chunk.pop("usage", None)
    return sse_frame(chunk)


def error_frame(message: str) -> bytes:
    return sse_frame(error_body(ErrorDetail(message=message, type=SERVER_ERROR, code="internal_error")))


async def sse_events(stream: TokenStream, writer: ChunkWriter, include_usage: bool,
                     continuous_usage: bool = False) -> AsyncIterator[bytes]:
    failed: list[bool] = []
    async for frame in choice_frames(stream, writer, include_usage, continuous_usage, failed):
        yield frame
    if include_usage and not failed:
        yield chunk_frame(writer.usage_chunk(usage_of(stream.last).model_dump()), include_usage=True)
    yield DONE_FRAME


async def choice_frames(stream: TokenStream, writer: ChunkWriter, include_usage: bool, continuous_usage: bool,
                        failed: list[bool]) -> AsyncIterator[bytes]:
    """One choice's frames: its opening, its deltas, or an error event (then `failed` gets a True)."""
    for chunk in writer.opening():
        if continuous_usage:
            chunk["usage"] = _usage_so_far(stream.first, 0)
        yield chunk_frame(chunk, include_usage)
    async with contextlib.aclosing(stream.deltas()) as deltas:  # closing aborts the generation at once
        async for out in deltas:
            if out.finish_reason == FINISH_ERROR:
                failed.append(True)
                yield error_frame(stream.error_message or "generation failed")
                continue
            chunks = writer.for_delta(out)
            for chunk in chunks if continuous_usage else ():
                chunk["usage"] = _usage_so_far(out, out.num_output_tokens)
            frames = [chunk_frame(chunk, include_usage) for chunk in chunks]
            if frames:
                yield b"".join(frames)


def _usage_so_far(out: RequestOutput, completion_tokens: int) -> dict[str, Any]:
    return usage_of(dataclasses.replace(out, num_output_tokens=completion_tokens)).model_dump()


def usage_options(body: SamplingFields) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats), the latter only with the former (as vLLM has it)."""
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    return include_usage, include_usage and bool(options and options.continuous_usage_stats)


class SSEResponse:
    """An ASGI response streaming `frames`; a client hang-up stops it and closes `frames`
    (which aborts the generation)."""

    def __init__(self, frames: AsyncIterator[bytes]) -> None:
        self.frames = frames

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        async with CancelOnDisconnect(receive) as guard, contextlib.aclosing(self.frames) as frames:
            async for frame in frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        if guard.gone:
            log.info("client left mid-stream; aborted")


async def serve_generation(ctx: ServingContext, request: Request, body: SamplingFields, prompt: list[int],
                           params: SamplingParams, aliases: dict[str, str],
                           writer: ChunkWriter) -> Response | SSEResponse:
    """Run one generation and answer with SSE (`body.stream`) or one JSON body."""
    request_id = writer.request_id
    tokens: TokenStream | None = None
    async with CancelOnDisconnect(request.receive) as guard:
        tokens = await TokenStream.open(ctx, request_id, prompt, params, aliases)
        request.state.tokens = tokens  # for the access log
        if body.stream:
            return SSEResponse(sse_events(tokens, writer, *usage_options(body)))
        outputs = await tokens.collect()
    if guard.gone or tokens is None:
        if tokens is None:  # an opened stream counts its own outcome ("disconnected")
            ctx.metrics.count_request("disconnected")
        log.info("client left during %s; aborted", request_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if outputs[-1].finish_reason == FINISH_ERROR:
        raise APIError(500, tokens.error_message or "generation failed", SERVER_ERROR, code="internal_error")
    return Response(writer.whole(outputs).model_dump_json(), media_type="application/json")
