"""`VLLMEngine`: vLLM's v1 `AsyncLLM`, in the worker process, as an `EngineAdapter`.

    engine = VLLMEngine.from_args(args, worker_id)    # options checked here: ValueError names one
    await engine.start()                              # vLLM starts its engine core (EngineStartError)
    async for out in engine.generate(rid, prompt_ids, params): ...

vLLM's engine core runs in its own process; its KV events reach `VLLMEventBridge` over ipc:// in a
directory of this worker's, and its stats reach `TotalsLogger`. A watchdog stops the worker when
the engine core dies (the supervisor restarts it whole; the frontends migrate its streams).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import Request
from tokenmill.engine.stats import EngineStats
from tokenmill.engines import VLLM
from tokenmill.engines.adapter import EngineInfo, EngineStartError
from tokenmill.engines.vllm.config import EventEndpoints, engine_args_from
from tokenmill.engines.vllm.connector_scheduler import REMOTE_DECODE, REMOTE_PREFILL
from tokenmill.engines.vllm.events import VLLMEventBridge
from tokenmill.engines.vllm.handoff import RemotePrefill
from tokenmill.engines.vllm.requests import finish_reason, token_logprobs, vllm_params, vllm_prompt
from tokenmill.engines.vllm.stats import LoadBook, RequestBlocks, logger_for
from tokenmill.kv.events import KVEventEmitter
from tokenmill.runtime.scratch import scratch_dir
from tokenmill.textgen.outputs import FINISH_HANDOFF, FINISH_STOP, RequestOutput
from tokenmill.textgen.sampling import SamplingParams
from tokenmill.textgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.5


class VLLMEngine:
    def __init__(self, engine_args: Any, endpoints: EventEndpoints, run_dir: Path, worker_id: str,
                 block_size: int, tokenizer: Tokenizer, moves_kv: bool = False) -> None:
        self._engine_args = engine_args
        self._endpoints = endpoints
        self._run_dir = run_dir
        self._block_size = block_size
        self._events = KVEventEmitter(worker_id)
        self._bridge = VLLMEventBridge(self._events, block_size)
        self._book = LoadBook()
        self._tokenizer = tokenizer
        self._llm: Any = None
        self._info: EngineInfo | None = None
        self._output: OutputProcessor | None = None
        self._vocab_size = 0
        self._num_blocks = 0
        self._watchdog: asyncio.Task | None = None
        self._moves_kv = moves_kv  # a prefill or decode worker: vLLM runs tokenmill's connector
        self._handles: dict[str, dict[str, Any]] = {}  # request id -> its handoff's handle, until taken

    @classmethod
    def from_args(cls, args: argparse.Namespace, worker_id: str) -> VLLMEngine:
        """ValueError naming the flag or vLLM option at fault (before any process starts)."""
        run_dir = scratch_dir(f"vllm-{worker_id}")  # a SIGKILLed worker's supervisor removes it by pid
        # vLLM's own ipc sockets (engine core, outputs) go to /tmp and stay there after it exits;
        # in the run directory they leave with it (a user's own setting wins)
        os.environ.setdefault("VLLM_RPC_BASE_PATH", str(run_dir))
        try:
            endpoints = EventEndpoints.in_dir(run_dir)
            engine_args = engine_args_from(args, endpoints)
            return cls(engine_args, endpoints, run_dir, worker_id, args.block_size, Tokenizer(args.model),
                       moves_kv=args.role != "agg")
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise

    def discard(self) -> None:
        """Drop an engine that was never started (its options checked only)."""
        shutil.rmtree(self._run_dir, ignore_errors=True)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """vLLM's engine core up (EngineStartError with vLLM's reason otherwise, nothing left running)."""
        self._bridge.start(self._endpoints.publish, self._endpoints.replay, self._endpoints.topic)
        try:
            self._start_llm()
        except BaseException:
            await self.stop()
            raise
        self._watchdog = asyncio.create_task(self._watch())
        log.info("vLLM engine up: max_model_len %d, %d KV blocks of %d tokens", self.info.max_model_len,
                 self._num_blocks, self._block_size)

    def _start_llm(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            self._llm = AsyncLLM.from_engine_args(self._engine_args, stat_loggers=[logger_for(self._book.totals)])
        except Exception as exc:  # vLLM logs the root cause above; its exception names the stage
            raise EngineStartError(f"vLLM failed to start: {exc}") from exc
        config = self._llm.vllm_config
        if config.cache_config.block_size != self._block_size:
            raise EngineStartError(f"--block-size {self._block_size}: vLLM runs with block size "
                                   f"{config.cache_config.block_size}; the routers would hash other blocks")
        self._info = EngineInfo(VLLM, config.model_config.max_model_len, self._block_size, 0,
                                config.scheduler_config.max_num_seqs)
        self._vocab_size = config.model_config.get_vocab_size()
        self._num_blocks = int(config.cache_config.num_gpu_blocks or 0)
        # vLLM checks EOS, stop ids and lengths; the processor only makes text and finds stop strings
        self._output = OutputProcessor(self._tokenizer, frozenset(self._tokenizer.eos_token_ids),
                                       self._info.max_model_len)

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self._bridge.close()
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)
        shutil.rmtree(self._run_dir, ignore_errors=True)

    def is_running(self) -> bool:
        return self._llm is not None and not self._llm.errored

    async def _watch(self) -> None:
        """A dead engine core cannot serve: stop the worker (SIGTERM to ourselves) so its
        supervisor restarts it whole and the frontends move its streams elsewhere."""
        while not self._llm.errored:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        log.error("vLLM's engine core died; stopping the worker")
        os.kill(os.getpid(), signal.SIGTERM)

    # -- the adapter -----------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("the vLLM engine has not started")
        return self._info

    @property
    def events(self) -> KVEventEmitter:
        return self._events

    async def stats(self) -> EngineStats:
        return self._book.stats(self._num_blocks, self._block_size)

    def idle_stats(self) -> EngineStats:
        return self._book.stats(self._num_blocks, self._block_size)

    async def kv_snapshot(self) -> tuple[int, dict[str, list[int]]]:
        return self._events.last_event_id, self._bridge.view()  # both kept on this loop thread

    async def set_tiers_enabled(self, enabled: bool) -> bool:
        return False  # tokenmill's KV tiers are the own engine's; vLLM's offload is configured at start

    async def pin_prefix(self, token_ids: list[int]) -> bool:
        raise ValueError("pinning a prefix needs tokenmill's KV tiers, which a vLLM worker does not run")

    async def call(self, fn: Any) -> Any:
        return fn(self._llm)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       extra_key: str | None = None, output_offset: int = 0, text_pending: int = 0, *,
                       prefill_only: bool = False, kv_import: Any = None) -> AsyncIterator[RequestOutput]:
        """`prefill_only`: one token, then the prompt's KV held for a decode worker (the last delta
        ends with FINISH_HANDOFF and `take_handle` has the connector's handle); `kv_import` (a
        `RemotePrefill`): the prompt's KV is pulled from the prefill worker that holds it."""
        if (prefill_only or kv_import is not None) and not self._moves_kv:
            raise ValueError("an agg vLLM worker does not hand KV off to other workers")
        if kv_import is not None and not isinstance(kv_import, RemotePrefill):
            raise ValueError("a vLLM worker pulls KV only through its connector's handles")
        self._validate(prompt_token_ids)
        request = Request(request_id, list(prompt_token_ids), params, extra_key, output_offset, text_pending)
        output = self._output
        if output is None:
            raise RuntimeError("the vLLM engine has not started")
        output.add(request)
        book = self._book.requests[request_id] = RequestBlocks(len(prompt_token_ids))
        handoff = prefill_only and params.max_tokens != 1  # a one-token request simply ends here
        stream = self._llm.generate(vllm_prompt(prompt_token_ids, extra_key),
                                    self._transfer_params(vllm_params(params), handoff, kv_import), request_id)
        try:
            async for out in stream:
                delta = self._delta(request, book, out, handoff)
                yield delta
                if delta.finished:
                    break
        finally:
            output.remove(request_id)
            self._book.requests.pop(request_id, None)
            await stream.aclose()  # before vLLM finished: this aborts it there, which frees its blocks

    def take_handle(self, request_id: str) -> dict[str, Any] | None:
        """The connector's handle for a request that ended with FINISH_HANDOFF (None if vLLM held
        nothing: the decode worker then computes the prompt itself)."""
        return self._handles.pop(request_id, None)

    @staticmethod
    def _transfer_params(params: Any, handoff: bool, kv_import: RemotePrefill | None) -> Any:
        if handoff:
            params.max_tokens = 1
            params.extra_args = {"kv_transfer_params": {REMOTE_DECODE: True}}
        elif kv_import is not None:
            params.extra_args = {"kv_transfer_params": {**kv_import.handle, REMOTE_PREFILL: True}}
        return params

    def _validate(self, prompt: list[int]) -> None:
        """The own engine's checks and messages, so a client sees the same error whichever serves."""
        if not prompt:
            raise ValueError("prompt must be a non-empty list of token ids")
        if len(prompt) >= self.info.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; the context length is {self.info.max_model_len} "
                             "(and at least one token must be generated)")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self._vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {self._vocab_size})")

    def _delta(self, request: Request, book: RequestBlocks, out: Any, handoff: bool = False) -> RequestOutput:
        """One vLLM delta as tokenmill's, its tokens fed to the text one at a time so a stop string
        ends the request at the token that completed it (as on the own engine). A handoff's text
        stays pending when any of it is held back: the decode worker continues it."""
        completion = out.outputs[0]
        new = list(completion.token_ids)
        reason = finish_reason(completion.finish_reason) if out.finished else None
        handed = handoff and out.finished and completion.finish_reason == "length"  # its one token, no stop
        stop_reason = completion.stop_reason
        text = ""
        for i, token in enumerate(new):
            last = i == len(new) - 1
            piece, matched = self._output.text_delta(request, [token], out.finished and last and not handed)
            text += piece
            if matched is not None:
                new, reason, stop_reason, handed = new[:i + 1], FINISH_STOP, matched, False
                break
        request.output_token_ids.extend(new)
        book.cached_tokens = out.num_cached_tokens or 0
        book.output_tokens = len(request.output_token_ids)
        logprobs = token_logprobs(new, completion.logprobs, request.params.logprobs)
        pending = self._output.pending_tokens(request.request_id)
        if handed:
            if out.kv_transfer_params is not None:
                self._handles[request.request_id] = dict(out.kv_transfer_params)
            reason, stop_reason = FINISH_HANDOFF, None
            if self._output.holds_text(request.request_id):
                text, pending = "", len(request.output_token_ids)
        return RequestOutput(request.request_id, new, text, reason is not None, reason,
                             request.num_prompt_tokens, len(request.output_token_ids), book.cached_tokens,
                             logprobs, stop_reason, pending)
