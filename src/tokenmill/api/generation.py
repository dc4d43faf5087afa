"""One request's token stream from the backend, as the route handlers consume it.

`TokenStream.open` waits for the first delta, so every refusal the backend makes
before generating (bad values, overload, no workers) becomes an HTTP status before
any response header is sent. The stream then records TTFT/ITL and the outcome, and
closing it early (client gone) aborts the request in the backend.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive

from tokenmill.api.errors import APIError, from_value_error, overloaded_error, unavailable_error
from tokenmill.api.metrics import FrontendMetrics, RequestTimer
from tokenmill.api.tenancy import FleetQueue
from tokenmill.backend import Backend, BackendUnavailable, Overloaded
from tokenmill.tenants.usage import Tenancy
from tokenmill.textgen.outputs import FINISH_ABORT, FINISH_ERROR, RequestOutput
from tokenmill.textgen.sampling import SamplingParams

log = logging.getLogger(__name__)

@dataclass(slots=True)
class ServingContext:
    """What every route handler needs; one per app."""
    backend: Backend
    metrics: FrontendMetrics
    served_model_name: str
    request_timeout_s: float | None
    max_body_bytes: int
    created: int
    tool_call_parser: str | None = None  # hermes, llama3_json; None: read from the chat template
    planner: Any = None  # `serve --planner`: the in-process planner (planner/in_process.PlannerTask)
    tenancy: Tenancy | None = None  # `--tenants FILE`: each tenant's quotas and usage
    queue: FleetQueue | None = None  # `--max-in-flight N`: requests beyond N wait, fairly shared out


def outcome(finish_reason: str | None) -> str:
    """The `status` label of tokenmill_requests_total for a finished stream."""
    return {FINISH_ABORT: "deadline", FINISH_ERROR: "error"}.get(finish_reason or "", "success")


class TokenStream:
    def __init__(self, source: AsyncIterator[RequestOutput], first: RequestOutput, timer: RequestTimer) -> None:
        self.source = source
        self.first = first
        self.timer = timer
        self.last = first
        self.error_message: str | None = None

    @classmethod
    async def open(cls, ctx: ServingContext, request_id: str, prompt: list[int], params: SamplingParams,
                   aliases: dict[str, str], follow: str | None = None) -> TokenStream:
        timer = ctx.metrics.start_request(len(prompt))
        if timer.scope is not None and timer.scope.account is not None:
            params.priority = timer.scope.account.tenant.priority  # the engine orders requests by it
        deadline = None if ctx.request_timeout_s is None else time.monotonic() + ctx.request_timeout_s
        source = ctx.backend.generate(request_id, prompt, params, deadline, follow=follow)
        try:
            first = await anext(source)
        except ValueError as exc:
            raise from_value_error(exc, aliases) from exc
        except Overloaded as exc:
            raise overloaded_error(exc) from exc
        except BackendUnavailable as exc:
            raise unavailable_error(exc) from exc
        except StopAsyncIteration as exc:
            raise APIError(500, "the backend ended the stream without output", "server_error") from exc
        return cls(source, first, timer)

    async def deltas(self) -> AsyncIterator[RequestOutput]:
        """Every delta, ending with a finished one (a backend failure becomes an "error" delta)."""
        status = "disconnected"  # unless the stream runs to its end
        out = self.first
        try:
            while True:
                self.last = out
                self.timer.on_tokens(len(out.new_token_ids), out.step_seconds)
                yield out
                if out.finished:
                    status = outcome(out.finish_reason)
                    return
                out = await self._next()
        finally:
            await self.source.aclose()  # aborts an unfinished request and frees its KV
            last = self.last
            self.timer.on_finish(status, last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)

    async def _next(self) -> RequestOutput:
        try:
            return await anext(self.source)
        except StopAsyncIteration:
            self.error_message = "the backend ended the stream without a final delta"
        except (BackendUnavailable, OSError, RuntimeError, ValueError) as exc:
            log.exception("request %s failed mid-stream", self.last.request_id)
            self.error_message = f"generation failed: {exc}"
        last = self.last
        return RequestOutput(last.request_id, [], "", True, FINISH_ERROR, last.num_prompt_tokens,
                             last.num_output_tokens, last.num_cached_tokens)

    async def close(self) -> None:
        """Abandon the stream unread (another choice of its request failed): aborts its generation."""
        await self.source.aclose()

    async def collect(self) -> list[RequestOutput]:
        return [out async for out in self.deltas()]


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class CancelOnDisconnect:
    """`async with CancelOnDisconnect(receive) as guard:` — if the client hangs up inside the
    block, the current task is cancelled there (so its generation is aborted and its KV freed),
    the cancellation ends at the block, and `guard.gone` is True. One watcher task per block:
    the work itself runs in the request's own task, not in one more."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.gone = False
        self._active = False
        self._task: asyncio.Task | None = None
        self._watcher: asyncio.Future | None = None

    async def __aenter__(self) -> CancelOnDisconnect:
        self._task = asyncio.current_task()
        self._active = True
        self._watcher = asyncio.ensure_future(_wait_for_disconnect(self.receive))
        self._watcher.add_done_callback(self._on_watcher_done)
        return self

    def _on_watcher_done(self, watcher: asyncio.Future) -> None:
        if watcher.cancelled() or watcher.exception() is not None:
            return
        self.gone = True
        if self._active and self._task is not None:
            self._task.cancel()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        self._active = False
        if self._watcher is not None:
            self._watcher.cancel()
        if kind is not None and issubclass(kind, (asyncio.CancelledError, APIError)) and self.gone:
            if issubclass(kind, asyncio.CancelledError) and self._task is not None:
                self._task.uncancel()
            return True  # the client left: nothing to answer, nothing to propagate
        return False
