"""What one engine step computes, as counts: the shape a step-time model prices.

Torch-free on purpose: the mock runner builds it from a `SchedulerOutput`, and the fleet
simulator builds the same thing from its own simulated batches, so one step-time function
(`seconds(work) -> float`, e.g. the simulator's `StepClock`) clocks both.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class ScheduledChunk(Protocol):
    """One sequence's part of a step: the engine's `ScheduledSeq`, the simulator's `Chunk`."""

    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def is_decode(self) -> bool: ...

    @property
    def samples(self) -> bool: ...


@dataclass(slots=True, frozen=True)
class StepWork:
    prefill_tokens: int = 0  # new prompt tokens computed this step
    prefill_attended: float = 0.0  # Σ over prefill tokens of the keys each attends to (causal)
    prefill_kv_tokens: int = 0  # Σ over prefill chunks of the KV length at the chunk's end
    decode_seqs: int = 0  # sequences computing one token each
    decode_kv_tokens: int = 0  # Σ over decoding sequences of their KV length (this token included)
    sampled: int = 0  # sequences that sample a token this step (LM-head rows)

    @property
    def kv_tokens_read(self) -> int:
        return self.prefill_kv_tokens + self.decode_kv_tokens

    @staticmethod
    def chunk_attended(start: int, num_tokens: int) -> float:
        """Keys attended by the tokens start..start+num_tokens-1, each seeing itself and all before."""
        return num_tokens * (start + (num_tokens + 1) / 2.0)


def work_of(chunks: Iterable[ScheduledChunk]) -> StepWork:
    """The counts of one scheduled step, as a step-time model prices them.

    A decode computes one token at position `start`, reading `start + 1` keys (its own
    included); a prefill chunk computes `num_tokens` from `start`, its KV reaching
    `start + num_tokens`.
    """
    prefill_tokens = prefill_kv = decode_seqs = decode_kv = sampled = 0
    attended = 0.0
    for chunk in chunks:
        if chunk.is_decode:
            decode_seqs += 1
            decode_kv += chunk.start + 1
        else:
            prefill_tokens += chunk.num_tokens
            prefill_kv += chunk.start + chunk.num_tokens
            attended += StepWork.chunk_attended(chunk.start, chunk.num_tokens)
        sampled += int(chunk.samples)
    return StepWork(prefill_tokens, attended, prefill_kv, decode_seqs, decode_kv, sampled)


class StepClock(Protocol):
    def seconds(self, work: StepWork) -> float:
        """Modelled duration of one step, in seconds."""
        ...
