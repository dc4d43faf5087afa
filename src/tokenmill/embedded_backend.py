"""`Backend` over one in-process `AsyncLLMEngine`: admission control, deadlines, gauges.

Admission: at most `max_num_seqs + max_queue` requests are in flight (running plus
waiting); one more raises `Overloaded` so the HTTP layer answers 429 instead of
queueing without bound. `max_queue=None` admits everything.
Deadline: a request still unfinished at its `deadline` (a `time.monotonic()` instant)
is aborted in the engine, which frees its KV, and the stream ends with a final
delta whose `finish_reason` is "abort".
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from tokenmill.backend import Overloaded, tier_gauges
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.kv_tiers_wiring import tier_load
from tokenmill.engine.stats import EngineStats
from tokenmill.textgen.outputs import FINISH_ABORT, RequestOutput
from tokenmill.textgen.sampling import SamplingParams
from tokenmill.textgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_STATS_INTERVAL_S = 0.5


class LocalBackend:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_queue: int | None = None,
                 worker_id: str = "local") -> None:
        if engine.engine.tokenizer is None:
            raise ValueError("LocalBackend needs an engine with a tokenizer")
        self.engine = engine
        self.model_name = model_name
        self.max_model_len: int = engine.engine.max_model_len
        self.tokenizer: Tokenizer = engine.engine.tokenizer
        self.worker_id = worker_id
        self.max_in_flight = None if max_queue is None else engine.engine.config.max_num_seqs + max_queue
        self.in_flight = 0
        self._stats: EngineStats | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self._started = False

    async def start(self) -> None:
        await self.engine.start()
        self._started = True
        self._stats = await self.engine.stats()
        self._stats_task = asyncio.create_task(self._poll_stats(), name="local-backend-stats")

    async def stop(self) -> None:
        self._started = False
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
        await self.engine.stop()

    async def pin_prefix(self, token_ids: list[int]) -> dict[str, str | None]:
        try:
            ok = await self.engine.pin_prefix(token_ids)
        except ValueError as exc:
            return {self.worker_id: str(exc)}
        return {self.worker_id: None if ok else "refused (pin cap reached or no full block)"}

    def healthy(self) -> bool:
        return self._started and self.engine.is_running()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: float | None = None, follow: str | None = None) -> AsyncIterator[RequestOutput]:
        # `follow` needs no handling: one engine serves every request
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            raise Overloaded(retry_after=1, message=f"{self.in_flight} requests in flight (limit "
                                                     f"{self.max_in_flight}); retry later")
        self.in_flight += 1
        stream = self.engine.generate(request_id, prompt_token_ids, params)
        last: RequestOutput | None = None
        try:
            while last is None or not last.finished:
                try:
                    async with asyncio.timeout(_seconds_until(deadline)):
                        last = await anext(stream)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    log.info("request %s passed its deadline; aborted", request_id)
                    yield _aborted(request_id, len(prompt_token_ids), last)
                    return
                yield last
        finally:
            self.in_flight -= 1
            await stream.aclose()  # aborts an unfinished request, freeing its KV

    def metrics_snapshot(self) -> dict[str, float]:
        stats = self._stats
        snapshot = {"tokenmill_workers": 1.0 if self.healthy() else 0.0,
                    "tokenmill_frontend_requests_in_flight": float(self.in_flight)}
        if stats is not None:
            worker = f'{{worker="{self.worker_id}"}}'
            snapshot[f"tokenmill_worker_kv_usage{worker}"] = stats.kv_usage
            snapshot[f"tokenmill_worker_prefix_hit_rate{worker}"] = stats.prefix_hit_rate
            snapshot[f"tokenmill_worker_num_waiting{worker}"] = float(stats.num_waiting)
            snapshot[f"tokenmill_worker_num_running{worker}"] = float(stats.num_running)
            snapshot[f"tokenmill_worker_prefill_tokens{worker}"] = float(stats.prefill_tokens)
            snapshot[f"tokenmill_worker_onboarded_tokens{worker}"] = float(stats.onboarded_tokens)
            snapshot[f"tokenmill_worker_spec_draft_tokens{worker}"] = float(stats.spec_draft_tokens)
            snapshot[f"tokenmill_worker_spec_accepted_tokens{worker}"] = float(stats.spec_accepted_tokens)
            snapshot[f"tokenmill_worker_busy_seconds_total{worker}"] = stats.busy_seconds
            snapshot.update(tier_gauges(self.worker_id, tier_load(stats.tier_stats)))
        return snapshot

    async def _poll_stats(self) -> None:
        """Engine stats live on the engine thread; keep a recent copy for the synchronous snapshot."""
        while True:
            await asyncio.sleep(_STATS_INTERVAL_S)
            try:
                self._stats = await self.engine.stats()
            except Exception:
                log.exception("reading engine stats failed")


def _seconds_until(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _aborted(request_id: str, num_prompt_tokens: int, last: RequestOutput | None) -> RequestOutput:
    return RequestOutput(request_id, [], "", True, FINISH_ABORT, num_prompt_tokens,
                         last.num_output_tokens if last else 0, last.num_cached_tokens if last else 0)
