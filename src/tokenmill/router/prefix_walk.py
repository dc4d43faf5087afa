"""Prefix walks over worker bitmasks: the hot loop of every KV routing decision.

An index maps a chained block hash to an int whose bit `s` is set when the worker in
slot `s` holds that block (Python ints are unbounded, so any number of workers fits).
Because chained hashes encode their whole prefix (ARCHITECTURE.md "Block hashing"), the
longest prefix a worker holds is found by walking the request's hashes from block 0
and AND-ing masks: a worker drops out at the first block it lacks.

Both walks cost one dict lookup and a few int operations per block, and touch
per-worker bookkeeping only where the set of holders changes, so a 256-block prompt
over 64 workers stays in the tens of microseconds.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from itertools import islice

MaskGetter = Callable[[int, int], int]  # dict.get(hash, 0) of a hash -> worker-mask index


def iter_slots(mask: int) -> Iterator[int]:
    """Slot numbers of the bits set in `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def walk_one_tier(hashes: Sequence[int], get: MaskGetter) -> dict[int, int]:
    """slot -> number of leading blocks of `hashes` that the slot's worker holds (> 0 only)."""
    lengths: dict[int, int] = {}
    if not hashes:
        return lengths
    alive = get(hashes[0], 0)
    if not alive:
        return lengths
    depth = 1
    for block_hash in islice(hashes, 1, None):
        held = get(block_hash, 0) & alive
        if held != alive:
            for slot in iter_slots(alive ^ held):
                lengths[slot] = depth
            if not held:
                return lengths
            alive = held
        depth += 1
    for slot in iter_slots(alive):
        lengths[slot] = depth
    return lengths


def _tier_split(block_hash: int, getters: Sequence[MaskGetter], alive: int) -> tuple[tuple[int, ...], int]:
    """Each tier's mask of `alive` workers holding the block, a worker counted in its first
    (preferred) tier only; and the union of those masks."""
    remaining = alive
    split = []
    for get in getters:
        in_tier = get(block_hash, 0) & remaining
        split.append(in_tier)
        remaining ^= in_tier  # in_tier is a subset of remaining
    return tuple(split), alive ^ remaining


def walk_tiers(hashes: Sequence[int], getters: Sequence[MaskGetter]) -> dict[int, list[int]]:
    """slot -> per-tier counts (in `getters` order) of the leading blocks its worker holds.

    A worker's prefix ends at the first block it holds in no tier; each block of the
    prefix is counted once, in the first tier of `getters` that holds it. Runs of blocks
    with the same tier split are counted together, so bookkeeping happens only when the
    split changes.
    """
    counts: dict[int, list[int]] = {}
    if not hashes or not getters:
        return counts
    run_split, alive = _tier_split(hashes[0], getters, -1)  # -1: every bit set
    run_length = 1
    for block_hash in islice(hashes, 1, None):
        if not alive:
            break
        split, held = _tier_split(block_hash, getters, alive)
        if split == run_split:
            run_length += 1
            continue
        _add_run(counts, run_split, run_length, len(getters))
        run_split, run_length, alive = split, 1, held
    if alive:
        _add_run(counts, run_split, run_length, len(getters))
    return counts


def _add_run(counts: dict[int, list[int]], split: tuple[int, ...], length: int, num_tiers: int) -> None:
    for tier_index, mask in enumerate(split):
        for slot in iter_slots(mask):
            per_tier = counts.get(slot)
            if per_tier is None:
                per_tier = counts[slot] = [0] * num_tiers
            per_tier[tier_index] += length


class WorkerSlots:
    """Worker name <-> bit slot; a freed slot is reused lowest first so masks stay small."""

    def __init__(self) -> None:
        self.slot_of: dict[str, int] = {}
        self.worker_at: dict[int, str] = {}
        self._free: list[int] = []

    def assign(self, worker: str) -> int:
        slot = self.slot_of.get(worker)
        if slot is None:
            slot = heapq.heappop(self._free) if self._free else len(self.slot_of)
            self.slot_of[worker] = slot
            self.worker_at[slot] = worker
        return slot

    def release(self, worker: str) -> int | None:
        """Free the worker's slot; returns it (None for an unknown worker)."""
        slot = self.slot_of.pop(worker, None)
        if slot is not None:
            del self.worker_at[slot]
            heapq.heappush(self._free, slot)
        return slot
