"""A simulated worker's KV: block tables and prefix cache keyed by trace hashes, at fleet scale.

It keeps the engine's `kv.block_pool.BlockPool` semantics exactly — reference counts; one free
queue in LRU order that keeps freed blocks reusable until they are reallocated; allocation from
the queue's front (evicting a cached block there, with a `removed` event); tail-first freeing;
newly computed blocks registered only once their tokens are computed (a `stored` event over the
whole run); a hash computed twice cached once — and `KVCacheManager`'s lookup rule (leading full
blocks, never the last prompt position). `tests/sim/test_fleet_cache.py` replays random
operations through both and compares them.

What differs is the representation: a simulated replica has ~10⁵ blocks, a fleet a hundred
replicas, so blocks that hold no hash are not objects but runs of a count in the free queue, and
a sequence's block table lists the hash each of its blocks is registered under (None: none).
A simulated request has no token ids, so the blocks its generated tokens fill are hashed from a
per-request `salt` (chained like every block): as in the engine they are cached, announced, and
hit again when a preempted request is recomputed, but no other prompt can contain them.

Blocks a decode run will fill are `reserve`d when the run starts and taken when it ends, so
cached blocks are evicted no earlier than the engine, stepping one token at a time, would.
"""
from __future__ import annotations

import itertools
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from tokenmill.kv.events import KVEventEmitter
from tokenmill.kv.hashing import chain_hash

TIER = "device"


@dataclass(slots=True)
class SeqBlocks:
    hashes: list[int]  # chained hashes of the full blocks: the prompt's, then generated ones as they fill
    salt: int | None = None  # request-unique: hashes generated blocks (None: they are never cached)
    blocks: list[int | None] = field(default_factory=list)  # per held block: its registered hash, or None
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache

    def extend_generated(self, num_full: int) -> None:
        """Hashes for blocks up to `num_full`, past the prompt's: chained from the salt and position."""
        while len(self.hashes) < num_full:
            local = xxhash.xxh3_64_intdigest(struct.pack("<QQ", self.salt, len(self.hashes)))
            self.hashes.append(chain_hash(self.hashes[-1] if self.hashes else None, local))


class SimKV:
    def __init__(self, num_blocks: int, block_size: int, events: KVEventEmitter | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        self._runs = itertools.count()
        # LRU free queue, front first: a hash (a free cached block) -> None, or a run key -> its count
        self._free: OrderedDict[object, int | None] = OrderedDict({("run", next(self._runs)): num_blocks})
        self.num_free_blocks = num_blocks
        self._refs: dict[int, int] = {}  # every cached hash -> references held on its block
        self.reserved = 0  # free blocks promised to running decode runs

    def cached_prefix(self, seq: SeqBlocks, num_tokens: int) -> list[int]:
        """Cached leading blocks (their hashes) of a sequence of `num_tokens` known tokens."""
        hits: list[int] = []
        for block_hash in seq.hashes[:(num_tokens - 1) // self.block_size]:
            if block_hash not in self._refs:
                break
            hits.append(block_hash)
        return hits

    def allocate(self, seq: SeqBlocks, num_tokens_total: int, hits: list[int] | None = None) -> bool:
        """Blocks for the first `num_tokens_total` tokens, `hits` first; False, changing nothing, if short."""
        need = -(-num_tokens_total // self.block_size) - len(seq.blocks)
        if need <= 0 and not hits:
            return True  # the hot path: a decode step inside an already allocated block
        hits = hits or []
        need -= len(hits)
        if need > self.num_free_blocks - self.reserved - sum(1 for h in hits if self._refs[h] == 0):
            return False
        for block_hash in hits:
            if self._refs[block_hash] == 0:
                del self._free[block_hash]
                self.num_free_blocks -= 1
            self._refs[block_hash] += 1
        seq.blocks.extend(hits)
        if hits:
            seq.num_cached_blocks = len(seq.blocks)
        if need > 0:
            self._take(need)
            seq.blocks.extend([None] * need)
        return True

    def _take(self, n: int) -> None:
        """Pop `n` blocks off the queue's front; cached ones there lose their hash (evicted)."""
        evicted: list[int] = []
        self.num_free_blocks -= n
        while n:
            key, count = next(iter(self._free.items()))
            if count is None:  # a cached block
                del self._free[key]
                del self._refs[key]  # type: ignore[arg-type]
                evicted.append(key)  # type: ignore[arg-type]
                n -= 1
            elif count > n:
                self._free[key] = count - n
                n = 0
            else:
                del self._free[key]
                n -= count
        if evicted and self.events is not None:
            self.events.removed(TIER, evicted)

    def reserve(self, blocks: int) -> bool:
        """Promise `blocks` free blocks to a decode run; False, changing nothing, if too few."""
        if blocks > self.num_free_blocks - self.reserved:
            return False
        self.reserved += blocks
        return True

    def cache_computed(self, seq: SeqBlocks, num_computed: int) -> None:
        """Register the blocks that `num_computed` tokens have filled."""
        start = seq.num_cached_blocks
        num_full = min(num_computed // self.block_size, len(seq.blocks))
        if num_full <= start:
            return  # the hot path: a decode step inside a block
        if num_full > len(seq.hashes):
            if seq.salt is None:
                num_full = len(seq.hashes)
                if num_full <= start:
                    return
            else:
                seq.extend_generated(num_full)
        registered = False
        for i in range(start, num_full):
            block_hash = seq.hashes[i]
            if seq.blocks[i] is None and block_hash not in self._refs:
                self._refs[block_hash] = 1
                seq.blocks[i] = block_hash
                registered = True
        if registered and self.events is not None:
            self.events.stored(TIER, seq.hashes[start - 1] if start > 0 else None, list(seq.hashes[start:num_full]))
        seq.num_cached_blocks = num_full

    def free(self, seq: SeqBlocks) -> None:
        """Release every block of the sequence, tail first (children queue before parents)."""
        anonymous = 0  # consecutive hash-less blocks, queued as one run
        freed = 0  # a block another sequence still references stays taken
        for block_hash in reversed(seq.blocks):
            if block_hash is None:
                anonymous += 1
                continue
            if anonymous:
                self._free_anonymous(anonymous)
                freed, anonymous = freed + anonymous, 0
            self._refs[block_hash] -= 1
            if self._refs[block_hash] == 0:
                self._free[block_hash] = None
                freed += 1
        if anonymous:
            self._free_anonymous(anonymous)
            freed += anonymous
        self.num_free_blocks += freed
        seq.blocks = []
        seq.num_cached_blocks = 0

    def _free_anonymous(self, count: int) -> None:
        last = next(reversed(self._free), None)
        if isinstance(last, tuple):
            self._free[last] += count  # type: ignore[operator]
        else:
            self._free[("run", next(self._runs))] = count

    def cached_hashes(self) -> list[int]:
        return list(self._refs)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks
