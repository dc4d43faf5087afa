"""`IndexedTier`: the put/get/evict/event logic shared by tiers whose index lives in this process
(host memory, local disk, a shared directory); subclasses supply the storage.

Storage I/O runs outside the index lock, so a slow disk write on the offload
thread never stalls an engine-thread `get` for another block. A block being
written is already indexed; a `get` racing with it reads nothing and counts a
miss, which is always safe.

`on_evict`, when set, receives each block the tier gives up to make room
(hash, payload, meta, uses) before its bytes are erased: the manager hangs the
host → disk frequency filter there.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from tokenmill.kv.events import KVEventEmitter
from tokenmill.kv.tiers.base import BlockMeta, TierStats, validate_capacity, validate_tier_name
from tokenmill.kv.tiers.policy import BlockIndex, IndexEntry
from tokenmill.kv.tiers.record import CorruptBlock

log = logging.getLogger(__name__)

EvictionSink = Callable[[int, bytes, BlockMeta, int], None]
Prepared = TypeVar("Prepared")


class IndexedTier(Generic[Prepared]):
    def __init__(
        self, name: str, capacity_bytes: int, *, policy: str = "lru", max_pinned: int = 4096,
        events: KVEventEmitter | None = None,
    ) -> None:
        self.name = validate_tier_name(name)
        self.index = BlockIndex(validate_capacity(capacity_bytes), policy, max_pinned)
        self.stats = TierStats()
        self.events = events
        self.on_evict: EvictionSink | None = None
        self._lock = threading.RLock()

    # -- storage primitives a subclass provides -------------------------------------------
    def _prepare(self, block_hash: int, payload: bytes, meta: BlockMeta) -> tuple[Prepared, int]:
        """What `_write` stores, and the bytes it charges against capacity."""
        raise NotImplementedError

    def _write(self, block_hash: int, prepared: Prepared) -> bool:
        raise NotImplementedError

    def _read(self, block_hash: int) -> tuple[bytes, BlockMeta] | None:
        """None when the bytes are gone; raises CorruptBlock when they do not verify."""
        raise NotImplementedError

    def _erase(self, block_hash: int) -> None:
        raise NotImplementedError

    # -- the Tier protocol ---------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    def refresh(self, block_hash: int) -> bool:
        """What `put` does for a block already held (count a use, refresh its recency), without
        a payload: False when the block is absent."""
        with self._lock:
            return self.index.touch(block_hash)

    def put(self, block_hash: int, payload: bytes, meta: BlockMeta) -> bool:
        start = time.perf_counter()
        with self._lock:
            if self.index.touch(block_hash):
                return True
        prepared, size = self._prepare(block_hash, payload, meta)
        with self._lock:
            if block_hash in self.index:
                return True
            admission = self.index.admit(block_hash, size, meta.parent)
        self._give_up(admission.evicted)
        if not admission.admitted:
            self.stats.rejected += 1
            return False
        if not self._write(block_hash, prepared):
            with self._lock:
                self.index.remove(block_hash)
            self.stats.errors += 1
            return False
        self.stats.puts += 1
        self.stats.bytes_in += len(payload)
        self.stats.put_seconds += time.perf_counter() - start
        if self.events is not None:
            self.events.stored(self.name, meta.parent, [block_hash])
        return True

    def get(self, block_hash: int) -> tuple[bytes, BlockMeta] | None:
        start = time.perf_counter()
        if not self.contains(block_hash):
            self.stats.misses += 1
            return None
        found = self._read_verified(block_hash)
        if found is None:
            self.stats.misses += 1
            self._forget([block_hash])
            return None
        with self._lock:
            self.index.touch(block_hash)
        self.stats.hits += 1
        self.stats.bytes_out += len(found[0])
        self.stats.get_seconds += time.perf_counter() - start
        return found

    def contains(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self.index

    def contains_many(self, hashes: Sequence[int]) -> list[bool]:
        return [self.contains(h) for h in hashes]

    def delete(self, block_hash: int) -> bool:
        return bool(self._forget([block_hash]))

    def pin(self, hashes: Iterable[int]) -> bool:
        with self._lock:
            return self.index.pin(hashes)

    def unpin(self, hashes: Iterable[int]) -> None:
        with self._lock:
            self.index.unpin(hashes)

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self.index.entries)

    def uses(self, block_hash: int) -> int:
        """How often the block was stored or hit while here (0 when absent)."""
        with self._lock:
            entry = self.index.entries.get(block_hash)
            return entry.uses if entry else 0

    def close(self) -> None:
        """Nothing to release by default."""

    # -- helpers -------------------------------------------------------------------------
    def _read_verified(self, block_hash: int) -> tuple[bytes, BlockMeta] | None:
        try:
            return self._read(block_hash)
        except CorruptBlock as exc:
            log.warning("%s tier: block %#x does not verify (%s); dropping it", self.name, block_hash, exc)
            self.stats.corrupt += 1
            return None
        except OSError as exc:
            log.warning("%s tier: reading block %#x failed: %s", self.name, block_hash, exc)
            self.stats.errors += 1
            return None

    def _give_up(self, evicted: list[tuple[int, IndexEntry]]) -> None:
        """Hand evicted blocks to `on_evict`, erase their bytes, announce them."""
        for block_hash, entry in evicted:
            if self.on_evict is not None:
                found = self._read_verified(block_hash)
                if found is not None:
                    self.on_evict(block_hash, found[0], found[1], entry.uses)
            self._erase(block_hash)
        self.stats.evictions += len(evicted)
        if evicted and self.events is not None:
            self.events.removed(self.name, [h for h, _ in evicted])

    def _forget(self, hashes: Iterable[int]) -> list[int]:
        """Drop blocks from index and storage (deleted, missing, corrupt) and announce it."""
        with self._lock:
            gone = [h for h in hashes if self.index.remove(h) is not None]
        for block_hash in gone:
            self._erase(block_hash)
        if gone and self.events is not None:
            self.events.removed(self.name, gone)
        return gone
