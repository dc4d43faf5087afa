"""vLLM's scheduler and iteration stats as the worker's load (`EngineStats`), through a vLLM stat
logger (its stats API, not its log lines), so a vLLM worker's heartbeat, and the Prometheus
families the frontend derives from it, are the same as an own-engine worker's.

vLLM's stats say nothing per request; the blocks each request holds (what routers add to their
books for other frontends' requests) are counted by the adapter from the prompts and outputs it
sees (`RequestBlocks`), the way the own engine counts them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from tokenmill.engine.stats import EngineStats


@dataclass(slots=True)
class Totals:
    """What the stat logger has seen since the engine started (vLLM reports per-step deltas)."""
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_preemptions: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0


class TotalsLogger(StatLoggerBase):
    """A vLLM stat logger that keeps `Totals` (vLLM builds it through the factory `logger_for`)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, totals: Totals | None = None) -> None:
        self.totals = totals if totals is not None else Totals()

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        t = self.totals
        if scheduler_stats is not None:
            t.num_running = scheduler_stats.num_running_reqs
            t.num_waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            t.kv_usage = float(scheduler_stats.kv_cache_usage)
            t.queried_tokens += scheduler_stats.prefix_cache_stats.queries
            t.hit_tokens += scheduler_stats.prefix_cache_stats.hits
        if iteration_stats is not None:
            t.num_steps += 1
            # computed here, as the own engine counts them: not prefix hits, nor KV pulled from a prefill worker
            t.prefill_tokens += iteration_stats.prompt_token_stats.computed
            t.decode_tokens += iteration_stats.num_generation_tokens
            t.num_preemptions += iteration_stats.num_preempted_reqs

    def log_engine_initialized(self) -> None:
        pass


def logger_for(totals: Totals):
    """The factory vLLM calls once per engine core: every core's logger fills the same totals."""
    return lambda vllm_config, engine_index=0: TotalsLogger(vllm_config, engine_index, totals)


@dataclass(slots=True)
class RequestBlocks:
    """Blocks one request holds, as the own engine counts them: uncached prompt blocks before its
    first token (prefill), then its blocks beyond the prefix hits (decode)."""
    prompt_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0

    def blocks(self, block_size: int) -> tuple[int, int]:
        cached = self.cached_tokens // block_size
        if self.output_tokens == 0:
            return max(0, math.ceil(self.prompt_tokens / block_size) - cached), 0
        return 0, max(0, math.ceil((self.prompt_tokens + self.output_tokens) / block_size) - cached)


@dataclass(slots=True)
class LoadBook:
    totals: Totals = field(default_factory=Totals)
    requests: dict[str, RequestBlocks] = field(default_factory=dict)

    def stats(self, num_blocks: int, block_size: int) -> EngineStats:
        t = self.totals
        per_request = {rid: r.blocks(block_size) for rid, r in self.requests.items()}
        used = round(t.kv_usage * num_blocks)
        return EngineStats(
            num_running=t.num_running, num_waiting=t.num_waiting, kv_usage=t.kv_usage,
            num_free_blocks=num_blocks - used, num_blocks=num_blocks,
            prefix_hit_rate=t.hit_tokens / t.queried_tokens if t.queried_tokens else 0.0,
            num_steps=t.num_steps, prefill_tokens=t.prefill_tokens, decode_tokens=t.decode_tokens,
            prefill_step_seconds=0.0, decode_step_seconds=0.0, num_decode_only_steps=0,
            num_preemptions=t.num_preemptions,
            queried_tokens=t.queried_tokens, device_hit_tokens=t.hit_tokens, request_blocks=per_request)
