"""Requests with several choices: `n` > 1, and several prompts in one `/v1/completions`.

Every choice is its own generation (its own backend request). The choices of one prompt share
its prefill: the first is sent alone, and once its first token exists (its prompt's blocks are
in the prefix cache) the other n − 1 follow it to its worker (`Backend.generate(follow=...)`)
and find them there. That costs the later choices one prefill's wait, and saves n − 1 prefills.
With a seed, choice j draws from seed + j, so the choices differ and each stays reproducible.

Choice indices run prompt by prompt, as OpenAI's do: prompt i's choices are i·n … i·n + n − 1.
Usage counts each prompt once, every choice's output, and each prompt's cached tokens once
(its first choice's hit). Streams interleave the choices' chunks as they come, then the usage
chunk (with `include_usage`) and `[DONE]`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from tokenmill.api.errors import SERVER_ERROR, APIError
from tokenmill.api.generation import CancelOnDisconnect, ServingContext, TokenStream
from tokenmill.api.schema import PromptTokensDetails, SamplingFields, Usage
from tokenmill.api.streaming import (
    CLIENT_CLOSED_REQUEST,
    DONE_FRAME,
    ChunkWriter,
    SSEResponse,
    choice_frames,
    chunk_frame,
    serve_generation,
    usage_options,
)
from tokenmill.textgen.outputs import FINISH_ERROR, RequestOutput
from tokenmill.textgen.sampling import SamplingParams

log = logging.getLogger(__name__)

def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    return params if params.seed is None or j == 0 else dataclasses.replace(params, seed=params.seed + j)


async def _open_prompt(ctx: ServingContext, request_id: str, prompt: list[int], params: SamplingParams,
                       aliases: dict[str, str], n: int, first_index: int) -> list[TokenStream]:
    """The prompt's n streams: the first alone; once its first token exists (its prompt's blocks are
    cached) the rest follow it to its worker and find them there. Sent together, they would be
    admitted in one step and each compute the prompt."""
    lead = f"{request_id}-{first_index}"
    first = await TokenStream.open(ctx, lead, prompt, params, aliases)
    rest = [asyncio.ensure_future(TokenStream.open(ctx, f"{request_id}-{first_index + j}", prompt,
                                                   choice_params(params, j), aliases, follow=lead))
            for j in range(1, n)]
    try:
        return [first, *await _all_or_none(rest)]
    except BaseException:
        await first.close()
        raise


async def _all_or_none(opening: list[asyncio.Future]) -> list[TokenStream]:
    """Every stream `opening` yields; or, if one is refused (or we are cancelled), none: the ones
    already opened are closed, which aborts them."""
    try:
        return list(await asyncio.gather(*opening))
    except BaseException:
        for task in opening:
            task.cancel()
        for result in await asyncio.gather(*opening, return_exceptions=True):
            if isinstance(result, TokenStream):
                await result.close()
        raise


async def open_choices(ctx: ServingContext, request_id: str, prompts: list[list[int]], params: SamplingParams,
                       aliases: dict[str, str], n: int) -> list[TokenStream]:
    """Every choice's stream, in index order (prompts open side by side); all or none."""
    groups = [asyncio.ensure_future(_open_prompt(ctx, request_id, p, params, aliases, n, i * n))
              for i, p in enumerate(prompts)]
    try:
        opened = await asyncio.gather(*groups)
    except BaseException:
        for task in groups:
            task.cancel()
        for result in await asyncio.gather(*groups, return_exceptions=True):
            for stream in result if isinstance(result, list) else ():
                await stream.close()
        raise
    return [stream for group in opened for stream in group]


def total_usage(prompt_lens: list[int], outputs: list[list[RequestOutput]], n: int) -> Usage:
    completion = sum(choice[-1].num_output_tokens for choice in outputs)
    cached = sum(outputs[i * n][-1].num_cached_tokens for i in range(len(prompt_lens)))
    prompt = sum(prompt_lens)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def serve(ctx: ServingContext, request: Request, body: SamplingFields, prompts: list[list[int]],
                params: SamplingParams, aliases: dict[str, str], n: int,
                writer_for: Callable[[int], ChunkWriter]) -> Response | SSEResponse:
    """What both generation routes answer with: one choice on the lean path, several here."""
    if len(prompts) == 1 and n == 1:
        return await serve_generation(ctx, request, body, prompts[0], params, aliases, writer_for(0))
    return await serve_choices(ctx, request, body, prompts, params, aliases, n, writer_for)


async def serve_choices(ctx: ServingContext, request: Request, body: SamplingFields, prompts: list[list[int]],
                        params: SamplingParams, aliases: dict[str, str], n: int,
                        writer_for: Callable[[int], ChunkWriter]) -> Response | SSEResponse:
    """Run len(prompts) × n generations; answer with one SSE stream or one JSON body."""
    writers = [writer_for(index) for index in range(len(prompts) * n)]
    streams: list[TokenStream] = []
    async with CancelOnDisconnect(request.receive) as guard:
        streams = await open_choices(ctx, writers[0].request_id, prompts, params, aliases, n)
        if body.stream:
            include_usage, continuous = usage_options(body)
            lens = [len(p) for p in prompts]
            return SSEResponse(_interleaved(streams, writers, include_usage, continuous, lens, n))
        outputs = list(await asyncio.gather(*(stream.collect() for stream in streams)))
    if guard.gone or not streams:
        log.info("client left during %s; aborted", writers[0].request_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    failed = next((s for s, out in zip(streams, outputs) if out[-1].finish_reason == FINISH_ERROR), None)
    if failed is not None:
        raise APIError(500, failed.error_message or "generation failed", SERVER_ERROR, code="internal_error")
    usage = total_usage([len(p) for p in prompts], outputs, n)
    body_model = writers[0].response([w.choice(out) for w, out in zip(writers, outputs)], usage)
    return Response(body_model.model_dump_json(), media_type="application/json")


async def _interleaved(streams: list[TokenStream], writers: list[ChunkWriter], include_usage: bool,
                       continuous: bool, prompt_lens: list[int], n: int) -> AsyncIterator[bytes]:
    """Every choice's frames as they come, then the usage chunk and [DONE]; closing this closes all."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    failed: list[bool] = []

    async def pump(stream: TokenStream, writer: ChunkWriter) -> None:
        try:
            async with contextlib.aclosing(choice_frames(stream, writer, include_usage, continuous, failed)) as frames:
                async for frame in frames:
                    queue.put_nowait(frame)
        finally:
            queue.put_nowait(None)

    pumps = [asyncio.create_task(pump(s, w)) for s, w in zip(streams, writers)]
    try:
        for _ in pumps:
            while (frame := await queue.get()) is not None:
                yield frame
        if include_usage and not failed:
            usage = total_usage(prompt_lens, [[s.last] for s in streams], n)
            yield chunk_frame(writers[0].usage_chunk(usage.model_dump()), include_usage=True)
        yield DONE_FRAME
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
