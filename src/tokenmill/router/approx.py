"""Approximate KV index for engines that publish no KV events (`--router kv-approx`).

The router assumes a routed prompt's blocks now sit on the chosen worker's device:
`record(worker, hashes)` remembers each (worker, block) for `ttl_s` seconds (refreshed
when routed again) and keeps at most `max_blocks` entries, forgetting the oldest first.
`match` has the same contract as `KVIndexer.match` (every block counts as "device").
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tokenmill.router.indexer import WorkerMatches
from tokenmill.router.prefix_walk import WorkerSlots, walk_one_tier

APPROX_TIER = "device"


class ApproxIndexer:
    def __init__(self, ttl_s: float = 120.0, max_blocks: int = 1_000_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self.clock = clock
        self._holders: dict[int, int] = {}  # hash -> worker bitmask
        # (slot, hash) -> expiry; one TTL for all, so insertion order is expiry order
        self._expiry: OrderedDict[tuple[int, int], float] = OrderedDict()
        self._slots = WorkerSlots()

    def record(self, worker: str, hashes: Sequence[int]) -> None:
        """Remember that `worker` now holds the blocks `hashes`."""
        slot = self._slots.assign(worker)
        bit, expires = 1 << slot, self.clock() + self.ttl_s
        holders, expiry = self._holders, self._expiry
        for block_hash in hashes:
            key = (slot, block_hash)
            if key in expiry:
                expiry.move_to_end(key)
            else:
                holders[block_hash] = holders.get(block_hash, 0) | bit
            expiry[key] = expires
        while len(expiry) > self.max_blocks:
            self._forget(*expiry.popitem(last=False)[0])

    def match(self, hashes: Sequence[int]) -> WorkerMatches:
        self.expire()
        lengths = walk_one_tier(hashes, self._holders.get)
        worker_at = self._slots.worker_at
        return {worker_at[slot]: {APPROX_TIER: length} for slot, length in lengths.items()}

    def expire(self) -> int:
        """Forget entries past their TTL; returns how many."""
        now, expiry, dropped = self.clock(), self._expiry, 0
        while expiry:
            key, expires = next(iter(expiry.items()))
            if expires > now:
                break
            del expiry[key]
            self._forget(*key)
            dropped += 1
        return dropped

    def remove_worker(self, worker: str) -> None:
        slot = self._slots.slot_of.get(worker)
        if slot is None:
            return
        for key in [k for k in self._expiry if k[0] == slot]:
            del self._expiry[key]
            self._forget(*key)
        self._slots.release(worker)

    def num_blocks(self) -> int:
        return len(self._expiry)

    def _forget(self, slot: int, block_hash: int) -> None:
        mask = self._holders[block_hash] & ~(1 << slot)
        if mask:
            self._holders[block_hash] = mask
        else:
            del self._holders[block_hash]
