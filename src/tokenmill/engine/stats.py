"""What an engine reports of itself: `EngineStats`, the one shape the own engine and the vLLM adapter
both fill, read by the worker (its load report and heartbeats) and the embedded backend (metrics)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.engine.request import Request
    from tokenmill.engine.scheduler import SchedulerOutput


def request_blocks(requests: Iterable[Request], block_size: int) -> dict[str, tuple[int, int]]:
    """What the router charges, per request: (prefill, decode) blocks it holds beyond its
    prefix-cache hits — prefill before its first token, decode after."""
    blocks = {}
    for request in requests:
        held = -(-request.num_tokens // block_size) - request.num_cached_tokens // block_size
        blocks[request.request_id] = (0, held) if request.output_token_ids else (held, 0)
    return blocks


@dataclass(slots=True)
class StepCounters:
    """The own engine's running totals, from its start (`EngineStats` reports them)."""
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0  # a decoding sequence's rows in a step count one, whatever its drafts
    decode_only_steps: int = 0
    preemptions: int = 0
    prefill_seconds: float = 0.0  # steps that computed any prefill tokens
    decode_seconds: float = 0.0  # steps that only decoded

    def record_step(self, outs: Sequence[SchedulerOutput], seconds: float) -> None:
        """A step's totals; and its time shared out over its sequences by the tokens each computed
        (`Request.step_seconds`: the time each request's tokens caused, which a tenant is charged)."""
        tokens = sum(seq.num_tokens for out in outs for seq in out.seqs)
        for seq in (seq for out in outs for seq in out.seqs):
            seq.request.step_seconds += seconds * seq.num_tokens / tokens
        prefill_tokens = sum(out.num_prefill_tokens for out in outs)
        decode_seqs = sum(out.num_decode_seqs for out in outs)
        self.steps += 1
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_seqs
        if prefill_tokens:
            self.prefill_seconds += seconds
        else:
            self.decode_seconds += seconds
            self.decode_only_steps += 1


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_hit_rate: float
    num_steps: int
    prefill_tokens: int
    decode_tokens: int
    prefill_step_seconds: float  # steps that computed any prefill tokens
    decode_step_seconds: float  # steps that only decoded
    num_decode_only_steps: int
    num_preemptions: int
    onboarded_tokens: int = 0  # prompt tokens loaded from KV tiers instead of computed
    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache at admission
    device_hit_tokens: int = 0  # ... and found on the device
    num_held: int = 0  # prefill-only requests holding KV for a decode worker
    num_importing: int = 0  # requests waiting for their prompt KV to arrive
    spec_draft_tokens: int = 0  # speculative tokens verified by the target model
    spec_accepted_tokens: int = 0  # ... and confirmed by it (emitted without a step of their own)
    tier_stats: dict[str, Any] = field(default_factory=dict)  # TieredKVManager.stats(); {} without tiers
    request_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (prefill, decode) blocks

    @property
    def busy_seconds(self) -> float:
        """The time its steps took, from its start (busy ÷ wall time: how much of it was used)."""
        return self.prefill_step_seconds + self.decode_step_seconds

    @property
    def prefill_blocks(self) -> int:
        """Uncached blocks of requests still before their first token (waiting included)."""
        return sum(p for p, _ in self.request_blocks.values())

    @property
    def decode_blocks(self) -> int:
        """Blocks generating requests hold beyond their prefix hits."""
        return sum(d for _, d in self.request_blocks.values())
