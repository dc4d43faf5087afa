"""Synthetic KV state for `tokenmill bench router`: shared-prefix chains, events and prompts.

Hashes are real chained hashes (`kv.hashing.chain_hash`) over random local hashes, so
they look like the frontend's and the workers' without tokenizing anything. Shared
prefixes ("system prompts", documents) have Zipf-like popularity; every sequence a worker
caches is one of them cut at a random depth plus a unique tail.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from tokenmill.kv.events import BlockRemoved, BlockStored, KVEvent
from tokenmill.kv.hashing import chain_hash


@dataclass(slots=True)
class SyntheticFleet:
    workers: list[str]
    build_events: list[BlockStored]
    held: dict[str, deque[int]]    # per worker, its blocks oldest first (what eviction takes)
    chain_end: dict[str, int]      # per worker, the block its current request's next one extends
    next_event_id: dict[str, int]


class ChainFactory:
    def __init__(self, num_prefixes: int, prefix_blocks: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.prefixes = [self.extend(None, prefix_blocks) for _ in range(num_prefixes)]
        self._weights = [1.0 / (rank + 1) for rank in range(num_prefixes)]  # Zipf, s = 1

    def extend(self, parent: int | None, count: int) -> list[int]:
        """`count` new chained hashes continuing from `parent`."""
        getrandbits, out = self.rng.getrandbits, []
        for _ in range(count):
            parent = chain_hash(parent, getrandbits(64))
            out.append(parent)
        return out

    def sequence(self, total_blocks: int, shared_fraction: tuple[float, float] = (0.25, 1.0)) -> list[int]:
        """A popular prefix cut at a random depth, then unique blocks up to `total_blocks`."""
        prefix = self.rng.choices(self.prefixes, self._weights)[0]
        depth = min(len(prefix), total_blocks, int(total_blocks * self.rng.uniform(*shared_fraction)))
        shared = prefix[:depth]
        return shared + self.extend(shared[-1] if shared else None, total_blocks - depth)


def build_fleet(chains: ChainFactory, num_workers: int, total_blocks: int, sequence_blocks: int) -> SyntheticFleet:
    """Stored events (whole sequences, re-announced prefixes included) that leave
    `total_blocks` // `num_workers` distinct blocks on every worker."""
    workers = [f"worker-{i}" for i in range(num_workers)]
    per_worker = total_blocks // num_workers
    fleet = SyntheticFleet(workers, [], {}, {}, {})
    for worker in workers:
        held: dict[int, None] = {}  # insertion-ordered set
        events: list[BlockStored] = []
        while len(held) < per_worker:
            seq = chains.sequence(sequence_blocks)
            for depth, block_hash in enumerate(seq):
                held[block_hash] = None
                if len(held) == per_worker:
                    seq = seq[:depth + 1]
                    break
            events.append(BlockStored(worker, "device", None, tuple(seq), len(events)))
        fleet.build_events += events
        fleet.held[worker] = deque(held)
        fleet.chain_end[worker] = events[-1].hashes[-1]
        fleet.next_event_id[worker] = len(events)
    return fleet


def event_stream(fleet: SyntheticFleet, chains: ChainFactory, count: int, prompt_blocks: int,
                 output_blocks: int, chunk_blocks: int) -> list[KVEvent]:
    """The events a tokenmill worker emits in steady state, for `count` events in all.

    Each worker serves one request after another: its uncached prompt part (a random
    0–100% of `prompt_blocks`) is stored in prefill chunks of `chunk_blocks`, then one
    block per `block_size` output tokens during decode (`output_blocks` events). Its pool is
    full, so each allocation first evicts as many of its oldest blocks: every stored event
    is preceded by a removed event of the same size (`BlockPool.allocate`, then
    `cache_blocks`). Workers interleave at random.
    """
    rng, events = chains.rng, []
    plans: dict[str, list[int]] = {worker: [] for worker in fleet.workers}
    while len(events) < count:
        worker = fleet.workers[rng.randrange(len(fleet.workers))]
        plan = plans[worker]
        if not plan:
            uncached = rng.randint(1, prompt_blocks)
            plan += [chunk_blocks] * (uncached // chunk_blocks) + ([uncached % chunk_blocks] if uncached % chunk_blocks else [])
            plan += [1] * output_blocks
            plan.reverse()  # popped from the end
            # the request continues a cached prefix: one of the worker's recent blocks
            fleet.chain_end[worker] = fleet.held[worker][-rng.randint(1, min(256, len(fleet.held[worker])))]
        size = plan.pop()
        held = fleet.held[worker]
        if len(held) > size:
            gone = tuple(held.popleft() for _ in range(size))
            events.append(BlockRemoved(worker, "device", gone, _next_id(fleet, worker)))
        parent = fleet.chain_end[worker]
        blocks = chains.extend(parent, size)
        fleet.chain_end[worker] = blocks[-1]
        held.extend(blocks)
        events.append(BlockStored(worker, "device", parent, tuple(blocks), _next_id(fleet, worker)))
    return events[:count]


def _next_id(fleet: SyntheticFleet, worker: str) -> int:
    event_id = fleet.next_event_id[worker]
    fleet.next_event_id[worker] = event_id + 1
    return event_id


def decision_prompts(chains: ChainFactory, count: int, prompt_blocks: int) -> list[list[int]]:
    return [chains.sequence(prompt_blocks, shared_fraction=(0.0, 1.0)) for _ in range(count)]
