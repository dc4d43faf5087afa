"""`--mock-profile MODEL@GPU[:precision][:layout]`: the simulator as a mock worker's clock.

The worker is the one place that joins the simulator to the engine (ARCHITECTURE.md "Dependency rules": `worker → sim`
only for the mock runner's clock): it builds the simulator's `StepClock` for the profile and
hands it to the engine config, so every mock step lasts what the step-time model predicts for
that step's shape, and a KV pull between mock workers lasts what the GPU's link would take.
`tokenmill serve` calls `resolve_mock_profile` too, in its own process before any worker
starts, so a bad profile is one line at once, not a crash loop of workers.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.config import EngineConfig
    from tokenmill.sim.fleet.clock import StepClock

log = logging.getLogger(__name__)

FLAG = "--mock-profile"
# The mock runner keeps no tensors, but the block pool keeps ~200 bytes of bookkeeping per
# block: a million blocks is ~0.2 GB and ~0.7 s to build per worker, and dozens of workers share a box.
MAX_MOCK_KV_BLOCKS = 1_000_000


def load_clock(text: str) -> StepClock:
    """The profile's clock; ValueError (one line, naming --mock-profile) when the model or GPU is
    unknown, the layout is malformed or does not fit the model, or the weights do not fit."""
    from tokenmill.sim.fleet.clock import StepClock

    try:
        clock = StepClock.from_text(text, FLAG)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ValueError(_one_line(text, exc)) from None
    if clock.kv_capacity_tokens() <= 0:
        p = clock.profile
        raise ValueError(f"{FLAG} {text!r}: the weights of {p.model} at {p.precision} do not fit the memory of "
                         f"{p.gpus} {p.gpu} GPU(s) in layout {p.layout}, leaving no room for KV")
    return clock


def _one_line(text: str, exc: BaseException) -> str:
    message = " ".join(str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc).split())
    return message if message.startswith(FLAG) else f"{FLAG} {text!r}: {message}"


def profile_kv_blocks(clock: StepClock, block_size: int) -> int:
    """The profile's KV capacity in blocks of `block_size` tokens, capped at MAX_MOCK_KV_BLOCKS."""
    blocks = clock.kv_capacity_tokens() // block_size
    if blocks > MAX_MOCK_KV_BLOCKS:
        log.warning("%s %s holds %d KV blocks; capping the mock pool at %d (--kv-cache-blocks overrides)",
                    FLAG, clock.profile.describe(), blocks, MAX_MOCK_KV_BLOCKS)
        return MAX_MOCK_KV_BLOCKS
    return max(blocks, 1)


def resolve_mock_profile(config: EngineConfig, profile: str | None,
                         ) -> tuple[EngineConfig, StepClock | None]:
    """`config` with the profile's clock, and its KV capacity as the pool size unless the user
    sized the pool (`--kv-cache-blocks`/`--kv-cache-gb`); unchanged without a profile."""
    if profile is None:
        return config, None
    clock = load_clock(profile)
    changes: dict[str, object] = {"mock_step_time": clock}
    if config.num_kv_blocks is None and config.kv_cache_gb is None:
        changes["num_kv_blocks"] = profile_kv_blocks(clock, config.block_size)
    resolved = dataclasses.replace(config, **changes)
    log.info("%s %s: KV pool %s blocks, speedup %g", FLAG, clock.profile.describe(),
             resolved.num_kv_blocks if resolved.num_kv_blocks is not None else "(sized by --kv-cache-gb)",
             resolved.mock_speedup)
    return resolved, clock


def transfer_delay(clock: StepClock | None, speedup: float) -> Callable[[int], float] | None:
    """Seconds a mock KV pull of N tokens waits: the profile's link time between two instances of
    the profile (the fleet simulator's rule: NVLink when both fit one domain, else the NIC); None
    without a profile (mock pulls then move nothing, instantly)."""
    if clock is None:
        return None
    return lambda tokens: clock.transfer_seconds(tokens, clock.profile.gpus) / speedup
