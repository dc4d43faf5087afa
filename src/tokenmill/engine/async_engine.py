"""An asyncio front for `LLMEngine`: every request gets an async stream of
`RequestOutput` deltas.

A real forward pass steps on its own thread (torch releases the GIL while it computes,
so the event loop keeps serving meanwhile). All engine calls happen on that thread;
coroutines hand it commands through a thread-safe queue and get their results back
through futures, so the engine itself needs no locks.

The mock runner computes nothing, so a thread would only add GIL hand-offs and wake-ups
to every step: it steps inline, as a task on the event loop, awaiting each step's
modelled end instead of sleeping through it; commands then run at once, between steps.

Either way, a consumer that stops reading (client gone, task cancelled) aborts its
request, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.kv_handoff import ImportPlan
from tokenmill.engine.llm_engine import EngineStats, LLMEngine
from tokenmill.engine.mock_runner import MockRunner
from tokenmill.engines.adapter import EngineInfo
from tokenmill.kv.events import KVEventEmitter
from tokenmill.textgen.outputs import FINISH_ERROR, RequestOutput
from tokenmill.textgen.sampling import SamplingParams

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_TIMER_SLACK_S = 0.001  # the loop's timers fire to the millisecond; the last bit is slept exactly
_Command = tuple[Callable[[], Any], concurrent.futures.Future]


@dataclass(slots=True)
class KVImport:
    """The prompt's KV was computed elsewhere: `pull(plan)` copies it into `plan.block_ids` and
    says whether it arrived intact. It must not return (nor propagate a cancellation) while
    bytes may still land in those blocks. `decline()` says it will not be pulled at all (no room
    here: the prompt is prefilled again locally), so whoever holds it can free it now."""

    pull: Callable[[ImportPlan], Awaitable[bool]]
    decline: Callable[[], None] = lambda: None


class AsyncLLMEngine:
    """tokenmill's own engine as a worker's `engines.adapter.EngineAdapter`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._inline = isinstance(engine.runner, MockRunner)
        self._inline_task: asyncio.Task | None = None
        self._wake = asyncio.Event()  # inline: a command may have given the engine work

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._inline:
            self.engine.runner.defer_waits = True  # type: ignore[attr-defined]
            self._inline_task = asyncio.create_task(self._run_inline())
            return
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def info(self) -> EngineInfo:
        config = self.engine.config
        return EngineInfo("tokenmill", self.engine.max_model_len, config.block_size, config.hash_seed,
                          config.max_num_seqs, config.deterministic)

    @property
    def events(self) -> KVEventEmitter:
        return self.engine.events

    def idle_stats(self) -> EngineStats:
        return self.engine.stats()  # before serving the engine thread is idle: safe to read here

    async def kv_snapshot(self) -> tuple[int, dict[str, list[int]]]:
        """Taken on the engine thread, so the blocks and the event id agree."""
        return await self._call(lambda: (self.engine.events.last_event_id,
                                         {"device": self.engine.cached_hashes()}))

    def is_running(self) -> bool:
        """True while the engine's stepping (thread or task) is alive (a dead one cannot serve)."""
        if self._inline:
            return self._inline_task is not None and not self._inline_task.done()
        return self._thread is not None and self._thread.is_alive()

    async def stop(self) -> None:
        self._stopping.set()
        if self._inline_task is not None:
            self._wake.set()
            await asyncio.gather(self._inline_task, return_exceptions=True)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self.engine.close()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       extra_key: str | None = None, output_offset: int = 0,
                       text_pending: int = 0, *, prefill_only: bool = False,
                       kv_import: KVImport | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's deltas; raises ValueError (from validation) before the first.
        With `kv_import`, `prompt_token_ids` ends with the token the remote prefill sampled."""
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = stream
        try:
            if kv_import is None:
                await self._call(lambda: self.engine.add_request(request_id, prompt_token_ids, params, extra_key,
                                                                 output_offset, text_pending, prefill_only))
            else:
                await self._import(request_id, prompt_token_ids, params, extra_key, output_offset, text_pending,
                                   kv_import)
        except asyncio.CancelledError:
            self._streams.pop(request_id, None)
            self._submit(lambda: self.engine.abort(request_id))  # it may have been added before we gave up
            raise
        except Exception:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.engine.abort(request_id))

    async def _import(self, request_id: str, token_ids: list[int], params: SamplingParams, extra_key: str | None,
                      output_offset: int, text_pending: int, kv_import: KVImport) -> None:
        plan = await self._call(lambda: self.engine.begin_import(request_id, token_ids, params, extra_key,
                                                                 output_offset, text_pending))
        if plan is None:  # no room for the blocks now: queued to be prefilled here
            kv_import.decline()
            return
        ok = False
        try:
            ok = await kv_import.pull(plan) if plan.block_ids else True
        finally:  # also when cancelled: the caller's abort then finds the request scheduled
            await asyncio.shield(self._call(lambda: self.engine.finish_import(request_id, ok)))

    async def release_held(self, request_id: str) -> bool:
        return bool(await self._call(lambda: self.engine.release_held(request_id)))

    async def abort(self, request_id: str) -> bool:
        return bool(await self._call(lambda: self.engine.abort(request_id)))

    async def stats(self) -> EngineStats:
        return await self._call(self.engine.stats)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread (for admin and inspection)."""
        return await self._call(lambda: fn(self.engine))

    async def set_tiers_enabled(self, enabled: bool) -> bool:
        """`LLMEngine.set_tiers_enabled` on the engine thread, between steps."""
        return bool(await self._call(lambda: self.engine.set_tiers_enabled(enabled)))

    async def pin_prefix(self, token_ids: list[int]) -> bool:
        """`LLMEngine.pin_prefix` on the engine thread (ValueError without KV tiers)."""
        return bool(await self._call(lambda: self.engine.pin_prefix(list(token_ids))))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        if self._inline:
            result = fn()  # between steps by construction: we are on the loop the steps run on
            self._wake.set()
            return result
        return await asyncio.wrap_future(self._submit(fn))

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._inline:
            self._execute(fn, future)
            self._wake.set()
        else:
            self._commands.put((fn, future))
        return future

    # -- inline stepping (mock runner) ----------------------------------------------------

    async def _run_inline(self) -> None:
        runner: MockRunner = self.engine.runner  # type: ignore[assignment]
        while not self._stopping.is_set():
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            outputs = self._step()
            end = runner.take_step_end()
            if end is not None:
                await _sleep_until(end)
            elif not outputs:  # nothing could be scheduled (e.g. waiting for KV): don't spin
                await asyncio.sleep(_TIMER_SLACK_S)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
            await asyncio.sleep(0)  # let the consumers and new requests in before the next step

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception:  # a failed step must not leave streams waiting forever
            log.exception("engine step failed; failing every in-flight request")
            return self._fail_all()

    # -- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain_commands(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                continue
            for out in self._step():
                self._deliver(out)

    def _drain_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(fn, future)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _execute(fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return  # the caller gave up (cancelled) before the engine got to it: skip, don't add
        try:
            future.set_result(fn())
        except Exception as exc:
            future.set_exception(exc)

    def _fail_all(self) -> list[RequestOutput]:
        failed = []
        for request_id, request in list(self.engine.requests.items()):
            self.engine.abort(request_id)
            failed.append(RequestOutput(request_id, [], "", True, FINISH_ERROR, request.num_prompt_tokens,
                                        len(request.output_token_ids), request.num_cached_tokens))
        return failed

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, out)


async def _sleep_until(end: float) -> None:
    """Until `time.perf_counter()` reaches `end`: on the loop's timer, then exactly."""
    delay = end - time.perf_counter()
    if delay > 2 * _TIMER_SLACK_S:
        await asyncio.sleep(delay - _TIMER_SLACK_S)
    remaining = end - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
