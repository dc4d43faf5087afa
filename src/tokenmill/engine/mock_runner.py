"""The mock runner: the real scheduler and KV bookkeeping, a modelled forward pass.

A step takes `a + b·prefill_tokens + c·decode_seqs + d·kv_tokens_read` seconds
(the simulator can supply the coefficients), and tokens are a deterministic
function of the sequence so far, so fleets of mock workers behave reproducibly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import xxhash

from tokenmill.engine.runner import Sampled
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.kv.cache_manager import KVCacheManager


@dataclass(slots=True, frozen=True)
class StepTimeModel:
    """Seconds per step: a + b·prefill_tokens + c·decode_seqs + d·kv_tokens_read."""
    a: float = 2e-3
    b: float = 5e-5
    c: float = 2e-4
    d: float = 1e-7

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d"):
            if getattr(self, name) < 0:
                raise ValueError(f"mock step-time coefficient {name} must be >= 0")

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int) -> float:
        return self.a + self.b * prefill_tokens + self.c * decode_seqs + self.d * kv_tokens_read


class MockRunner:
    def __init__(self, step_time: StepTimeModel, vocab_size: int, special_ids: frozenset[int] = frozenset(),
                 sleep: bool = True) -> None:
        self.step_time = step_time
        self.token_space = [t for t in range(vocab_size) if t not in special_ids]  # never emits a special
        if not self.token_space:
            raise ValueError("mock runner needs at least one non-special token id")
        self.sleep = sleep
        self.modelled_seconds = 0.0

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> Sampled:
        seconds = self.step_time.step_seconds(out.num_prefill_tokens, out.num_decode_seqs, out.kv_tokens_read)
        self.modelled_seconds += seconds
        if self.sleep:
            time.sleep(seconds)
        return {s.request.request_id: (self._next_token(s.request.token_ids), None)
                for s in out.seqs if s.samples}

    def _next_token(self, token_ids: list[int]) -> int:
        # Depends on the last token and the position only: cheap, and identical on any worker.
        key = len(token_ids).to_bytes(4, "little") + token_ids[-1].to_bytes(4, "little")
        return self.token_space[xxhash.xxh3_64_intdigest(key) % len(self.token_space)]
