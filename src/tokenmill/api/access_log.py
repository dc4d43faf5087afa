"""One access-log line per request, at INFO on the `tokenmill.access` logger:

    cmpl-1f… POST /v1/completions 200 prompt=12 output=16 cached=0 ttft_ms=4.1 total_ms=31.7

Refusals show too (a 400 has no tokens: `prompt=- output=-`). `--no-access-log` turns it off;
at a log level above INFO nothing is formatted at all, so a benchmark pays nothing for it.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.types import Message, Send

from tokenmill.api.generation import TokenStream

log = logging.getLogger("tokenmill.access")


class AccessLog:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def active(self) -> bool:
        return self.enabled and log.isEnabledFor(logging.INFO)

    async def serve(self, request: Request, send: Send, respond: Callable[[Send], Awaitable[None]]) -> None:
        """`respond(send)`, then the line: status from the response, tokens from the request's stream
        (`request.state.tokens`, set by the generation route)."""
        started, status = time.monotonic(), 0

        async def recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await respond(recording)
        finally:
            tokens: TokenStream | None = getattr(request.state, "tokens", None)
            log.info("%s %s %s %s %s total_ms=%.1f", _request_id(tokens), request.method, request.url.path,
                     status or "-", _token_fields(tokens), (time.monotonic() - started) * 1e3)


def _request_id(tokens: TokenStream | None) -> str:
    return tokens.last.request_id if tokens is not None else "-"


def _token_fields(tokens: TokenStream | None) -> str:
    if tokens is None:
        return "prompt=- output=- cached=- ttft_ms=-"
    last, ttft = tokens.last, tokens.timer.ttft_s
    ttft_text = "-" if ttft is None else f"{ttft * 1e3:.1f}"
    return (f"prompt={last.num_prompt_tokens} output={last.num_output_tokens} cached={last.num_cached_tokens} "
            f"ttft_ms={ttft_text}")
