"""The mock runner: the real scheduler and KV bookkeeping, a modelled forward pass.

Each step is priced by a clock (anything with `seconds(StepWork) -> float`,
`tokenmill.step_work.StepClock`) from that step's real shape, and the runner waits that long
divided by `speedup`. The default clock is the linear `StepTimeModel` (`--mock-step-time`);
a worker started with `--mock-profile` hands in the simulator's clock for a model on a GPU,
so a box of mock workers keeps the time of that GPU fleet. The engine never imports the
simulator: the clock arrives through `EngineConfig.mock_step_time`.

Tokens are a deterministic function of the sequence so far, so fleets of mock workers behave
reproducibly.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from tokenmill.engine.request import Request
from tokenmill.engine.runner_protocol import Sampled
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.kv.cache_manager import KVCacheManager
from tokenmill.step_work import StepClock, StepWork, work_of

if TYPE_CHECKING:
    from tokenmill.engine.guided import MaskComputer


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

    def seconds(self, work: StepWork) -> float:
        return self.a + self.b * work.prefill_tokens + self.c * work.decode_seqs + self.d * work.kv_tokens_read


def step_work(out: SchedulerOutput) -> StepWork:
    """The step's counts; the split follows `ScheduledSeq.is_decode`, as the scheduler's own
    counters do, so `kv_tokens_read` equals `SchedulerOutput.kv_tokens_read`."""
    return work_of(out.seqs)


class MockRunner:
    def __init__(self, clock: StepClock, vocab_size: int, special_ids: frozenset[int] = frozenset(),
                 sleep: bool = True, speedup: float = 1.0) -> None:
        if not (math.isfinite(speedup) and speedup > 0):
            raise ValueError(f"mock_speedup must be a finite number > 0, got {speedup}")
        self.clock = clock
        self.token_space = [t for t in range(vocab_size) if t not in special_ids]  # never emits a special
        self.vocab_size = vocab_size
        self.special_ids = special_ids
        self._masks: MaskComputer | None = None
        if not self.token_space:
            raise ValueError("mock runner needs at least one non-special token id")
        self.sleep = sleep
        self.speedup = speedup
        self.modelled_seconds = 0.0  # unscaled model time of every step so far (speedup not applied)
        # Set by an asyncio driver (AsyncLLMEngine): the step's end is recorded, not slept
        # through, and the driver awaits it, so the worker's event loop keeps serving.
        self.defer_waits = False
        self._last_step_s = 0.0
        self._last_end: float | None = None  # perf_counter when the previous step's modelled time ended
        self._last_ids: set[str] = set()
        self._pending_end: float | None = None

    def close(self) -> None:
        """Nothing to release."""

    def step_seconds(self, measured: float) -> float:
        """The clock's time for the last step, as played (÷ speedup): the host's is no measure
        of it when the wait is deferred to the engine's loop."""
        return self._last_step_s

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> Sampled:
        seconds = self.clock.seconds(step_work(out))
        self.modelled_seconds += seconds
        self._last_step_s = seconds / self.speedup
        if self.sleep:
            self._wait(seconds / self.speedup, {s.request.request_id for s in out.seqs})
        elif self.defer_waits:
            self._pending_end = time.perf_counter()
        return {s.request.request_id: [(self._token_for(s.request), None)] for s in out.seqs if s.samples}

    def _token_for(self, request: Request) -> int:
        if request.matcher is None:
            return self._next_token(request.token_ids)
        return self._allowed_token(request)

    def _allowed_token(self, request: Request) -> int:
        """A constrained request's token: the same hash, over the tokens its grammar allows now
        (ordinary ones while there are any, so the mock writes text rather than stopping)."""
        if self._masks is None:
            from tokenmill.engine.guided import MaskComputer  # llguidance: only for structured outputs

            self._masks = MaskComputer(self.vocab_size)
        allowed = self._masks.compute([request.matcher])[0]
        ordinary = allowed.copy()
        ordinary[list(self.special_ids)] = False
        choices = np.flatnonzero(ordinary if ordinary.any() else allowed)
        return int(choices[self._hash(request.token_ids) % len(choices)])

    def take_step_end(self) -> float | None:
        """With `defer_waits`: the perf_counter instant the last step's tokens exist (None: no
        step ran since the last call)."""
        end, self._pending_end = self._pending_end, None
        return end

    def _wait(self, seconds: float, request_ids: set[str]) -> None:
        """Wait out the step, timed from the end of the previous one when it continues that one.

        A step whose sequences ran in the previous step follows it back to back, as on a GPU:
        the host time in between (scheduling, outputs, sockets) is part of the modelled step
        already (the step-time model counts the framework's per-step overhead), so it must not
        be added on top. After an idle spell the step is timed from now.
        """
        now = time.perf_counter()
        continues = self._last_end is not None and not request_ids.isdisjoint(self._last_ids)
        end = max((self._last_end if continues else now) + seconds, now)  # type: ignore[operator]
        self._last_end, self._last_ids = end, request_ids
        if self.defer_waits:
            self._pending_end = end
        elif end > now:
            time.sleep(end - now)

    def _next_token(self, token_ids: list[int]) -> int:
        return self.token_space[self._hash(token_ids) % len(self.token_space)]

    @staticmethod
    def _hash(token_ids: list[int]) -> int:
        # Depends on the last token and the position only: cheap, and identical on any worker.
        key = len(token_ids).to_bytes(4, "little") + token_ids[-1].to_bytes(4, "little")
        return xxhash.xxh3_64_intdigest(key)
