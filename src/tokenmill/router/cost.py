"""The KV routing cost: cache overlap against load, per candidate worker.

For a request of `prompt_blocks` = ceil(prompt_tokens / block_size) blocks and a worker
whose `match` overlap is `overlap_tier` leading blocks per tier:

    cached_blocks  = Σ_tier w_tier · overlap_tier          (w: device 1.0, host 0.75,
                                                            disk 0.25, shared 0.5)
    new_prefill    = max(0, prompt_blocks − cached_blocks)  blocks it would compute
    prefill        = new_prefill + active_prefill           its prefill backlog after this one
    request_decode = prompt_blocks − overlap_device         blocks the request newly allocates
                                                            on the worker's device and holds
                                                            until it ends (device hits are
                                                            shared; host/disk/shared hits are
                                                            onboarded into new device blocks)
    decode         = active_decode + request_decode
    shortfall      = blocks the request would lack on the worker's device: its prompt blocks not
                     held by the worker's active requests, beyond the pool's room (router/load.py)
    cost           = prefill_weight · prefill + decode + shortfall_weight · shortfall

A shortfall means the request would wait on that worker until enough of its running requests
finish (or preempt one): a cached prefix there is worth less than a worker where it fits now.

The lowest cost wins; ties go to the least loaded (active prefill + decode blocks), then
at random. With temperature T > 0 the worker is
sampled with probability ∝ exp(−c̃/T), c̃ = (cost − min) / (max − min) (all 0 when equal).

Worked example: a 10-block prompt, prefill_weight 1, device-only overlaps 2, 5
and 8 and no prefill backlog give prefill terms 8, 5, 2; with active decode blocks 2, 0
and 7 the decode terms are 2+8=10, 0+5=5, 7+2=9, so the costs are 18, 10 and 11 and the
second worker is chosen.
"""
from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tokenmill.kv.events import TIERS
from tokenmill.router.decision import WorkerTerms
from tokenmill.router.load import WorkerLoad

DEFAULT_TIER_WEIGHTS: dict[str, float] = {"device": 1.0, "host": 0.75, "disk": 0.25, "shared": 0.5}
TIE_TOLERANCE = 1e-9


@dataclass(slots=True)
class CostConfig:
    prefill_weight: float = 1.0
    tier_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    temperature: float = 0.0
    shortfall_weight: float = 4.0  # per block of device room the request would lack

    def __post_init__(self) -> None:
        if self.prefill_weight < 0:
            raise ValueError(f"prefill_weight must be >= 0, got {self.prefill_weight}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.shortfall_weight < 0:
            raise ValueError(f"shortfall_weight must be >= 0, got {self.shortfall_weight}")
        if set(self.tier_weights) != set(TIERS):
            raise ValueError(f"tier_weights must give exactly the tiers {TIERS}, got {sorted(self.tier_weights)}")
        for tier, weight in self.tier_weights.items():
            if not 0.0 <= weight <= 1.0:
                raise ValueError(f"tier weight for {tier!r} must be in [0, 1], got {weight}")

    def tier_preference(self) -> tuple[str, ...]:
        """Tiers best first: a block held in several counts in the heaviest one."""
        return tuple(sorted(TIERS, key=lambda tier: -self.tier_weights[tier]))


def worker_terms(worker: str, prompt_blocks: int, overlap: Mapping[str, int], load: WorkerLoad,
                 config: CostConfig, shortfall: float | None = None) -> WorkerTerms:
    """`shortfall`: blocks the request would lack room for on the worker (None: unknown, taken as 0)."""
    weights = config.tier_weights
    cached = sum(weights[tier] * blocks for tier, blocks in overlap.items())
    new_prefill = max(0.0, prompt_blocks - cached)
    request_decode = float(max(0, prompt_blocks - overlap.get("device", 0)))
    lacking = shortfall or 0.0
    cost = (config.prefill_weight * (new_prefill + load.prefill_blocks)
            + load.decode_blocks + request_decode + config.shortfall_weight * lacking)
    return WorkerTerms(worker, dict(overlap), cached, new_prefill, load.prefill_blocks,
                       request_decode, load.decode_blocks, cost, lacking)


def choose(terms: Sequence[WorkerTerms], temperature: float,
           rng: random.Random) -> tuple[int, str, float | None]:
    """(index of the chosen worker, why, its probability when sampled)."""
    if not terms:
        raise ValueError("no candidate workers to choose from")
    costs = [t.cost for t in terms]
    if temperature > 0 and len(terms) > 1:
        return _sample(terms, costs, temperature, rng)
    best = min(costs)
    tied = [i for i, c in enumerate(costs) if c - best <= TIE_TOLERANCE]
    if len(tied) > 1:  # equal cost: the least busy worker first, then chance
        lightest = min(_busy(terms[i]) for i in tied)
        tied = [i for i in tied if _busy(terms[i]) - lightest <= TIE_TOLERANCE]
    index = tied[0] if len(tied) == 1 else rng.choice(tied)
    chosen = terms[index]
    if len(tied) > 1:
        reason = f"tie at cost {best:g} among {len(tied)} equally loaded workers, broken at random"
    elif len([c for c in costs if c - best <= TIE_TOLERANCE]) > 1:
        reason = f"tie at cost {best:g}, broken towards the least loaded ({_busy(chosen):g} active blocks)"
    else:
        runner_up = min((c for i, c in enumerate(costs) if i != index), default=None)
        reason = f"lowest cost {best:g}" + ("" if runner_up is None else f" (next best {runner_up:g})")
    return index, f"{reason}; {chosen.describe()}", None


def _busy(terms: WorkerTerms) -> float:
    return terms.active_prefill + terms.active_decode


def _sample(terms: Sequence[WorkerTerms], costs: list[float], temperature: float,
            rng: random.Random) -> tuple[int, str, float]:
    low, high = min(costs), max(costs)
    span = high - low
    weights = [math.exp(-((c - low) / span if span else 0.0) / temperature) for c in costs]
    total = sum(weights)
    index = rng.choices(range(len(terms)), weights=weights)[0]
    probability = weights[index] / total
    reason = (f"sampled at temperature {temperature:g} with p={probability:.3f} "
              f"(costs {low:g}..{high:g}); {terms[index].describe()}")
    return index, reason, probability
