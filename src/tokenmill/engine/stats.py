"""What an engine reports of itself: `EngineStats`, the one shape the own engine and the vLLM adapter
both fill, read by the worker (its load report and heartbeats) and the embedded backend (metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    prefill_blocks: int  # uncached blocks of requests still before their first token (waiting included)
    decode_blocks: int  # blocks generating requests hold beyond their prefix hits
    onboarded_tokens: int = 0  # prompt tokens loaded from KV tiers instead of computed
    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache at admission
    device_hit_tokens: int = 0  # ... and found on the device
    num_held: int = 0  # prefill-only requests holding KV for a decode worker
    num_importing: int = 0  # requests waiting for their prompt KV to arrive
    spec_draft_tokens: int = 0  # speculative tokens verified by the target model
    spec_accepted_tokens: int = 0  # ... and confirmed by it (emitted without a step of their own)
    tier_stats: dict[str, Any] = field(default_factory=dict)  # TieredKVManager.stats(); {} without tiers
    request_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (prefill, decode) blocks
