"""What one engine step computes, as counts: the shape a step-time model prices.

Torch-free on purpose: the mock runner builds it from a `SchedulerOutput`, and the fleet
simulator builds the same thing from its own simulated batches, so one step-time function
(`seconds(work) -> float`, e.g. the simulator's `StepClock`) clocks both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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


class StepClock(Protocol):
    def seconds(self, work: StepWork) -> float:
        """Modelled duration of one step, in seconds."""
        ...
