"""Which blocks a tier holds, and which one it gives up next.

`BlockIndex` is pure bookkeeping (no I/O, not thread-safe; tiers lock around it):
- a byte budget: `used_bytes <= capacity_bytes` always;
- eviction order: LRU (least recently used first) or LFU (fewest uses first, LRU
  among equals), kept in a heap with lazy invalidation, so a touch is O(log n);
- a block whose children (blocks naming it as parent) are stored in the same
  tier is not evictable until they go: a tier never holds a child without the
  prefix that leads to it, when it can help it. The device pool frees chains
  tail first, so children usually arrive *before* their parent; child counts are
  therefore kept per parent hash whether or not the parent is present yet;
- pins are intents: a pinned hash is never evicted while present, and is pinned
  the moment it is stored. The number of pins is capped.
- `uses` counts puts and hits of a block while it stays in the tier; the host
  tier's frequency filter reads it when the block leaves.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

POLICIES: tuple[str, ...] = ("lru", "lfu")


@dataclass(slots=True)
class IndexEntry:
    size: int
    parent: int | None
    uses: int
    last_use: int


@dataclass(slots=True)
class Admission:
    admitted: bool
    evicted: list[tuple[int, IndexEntry]]  # (hash, entry) of the blocks given up to make room


class BlockIndex:
    def __init__(self, capacity_bytes: int, policy: str = "lru", max_pinned: int = 4096) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if policy not in POLICIES:
            raise ValueError(f"eviction policy is one of {POLICIES}, got {policy!r}")
        if max_pinned < 0:
            raise ValueError(f"max_pinned must be >= 0, got {max_pinned}")
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.max_pinned = max_pinned
        self.entries: dict[int, IndexEntry] = {}
        self.pinned: set[int] = set()
        self.used_bytes = 0
        self._children: dict[int, int] = {}  # parent hash -> children present
        self._heap: list[tuple[int, int, int]] = []  # (primary, last_use, hash)
        self._clock = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, block_hash: int) -> bool:
        """Count a use of a present block; False when absent."""
        entry = self.entries.get(block_hash)
        if entry is None:
            return False
        entry.uses += 1
        entry.last_use = self._tick()
        self._push(block_hash, entry)
        return True

    def admit(self, block_hash: int, size: int, parent: int | None) -> Admission:
        """Make room (evicting as needed) and add the block. When not enough can be
        evicted, the block is not added; what was evicted on the way stays evicted."""
        if block_hash in self.entries:
            raise ValueError(f"block {block_hash:#x} is already indexed")
        if size <= 0:
            raise ValueError(f"block size must be positive, got {size}")
        evicted: list[tuple[int, IndexEntry]] = []
        if size > self.capacity_bytes:
            return Admission(False, evicted)
        # Count the child first, so making room for it never evicts its own parent.
        entry = IndexEntry(size, parent, uses=1, last_use=self._tick())
        self.entries[block_hash] = entry
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
        self.used_bytes += size
        while self.used_bytes > self.capacity_bytes:
            victim = self._pop_victim()
            if victim == block_hash:  # re-pushed when a child of it went; it is pushed below
                continue
            if victim is None:
                self.remove(block_hash)
                return Admission(False, evicted)
            evicted.append((victim, self.remove(victim)))  # type: ignore[arg-type]
        self._push(block_hash, entry)
        return Admission(True, evicted)

    def remove(self, block_hash: int) -> IndexEntry | None:
        """Forget a block (evicted, deleted, found missing or corrupt); its heap slot goes stale."""
        entry = self.entries.pop(block_hash, None)
        if entry is None:
            return None
        self.used_bytes -= entry.size
        if entry.parent is not None:
            left = self._children.get(entry.parent, 0) - 1
            if left > 0:
                self._children[entry.parent] = left
            else:
                self._children.pop(entry.parent, None)
                parent_entry = self.entries.get(entry.parent)
                if parent_entry is not None:  # the parent may have just become evictable
                    self._push(entry.parent, parent_entry)
        return entry

    def evictable(self, block_hash: int) -> bool:
        return block_hash not in self.pinned and self._children.get(block_hash, 0) == 0

    def pin(self, hashes: Iterable[int]) -> bool:
        new = set(hashes) - self.pinned
        if len(self.pinned) + len(new) > self.max_pinned:
            return False
        self.pinned |= new
        return True

    def unpin(self, hashes: Iterable[int]) -> None:
        for block_hash in hashes:
            if block_hash in self.pinned:
                self.pinned.discard(block_hash)
                entry = self.entries.get(block_hash)
                if entry is not None:
                    self._push(block_hash, entry)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _priority(self, entry: IndexEntry) -> int:
        return entry.uses if self.policy == "lfu" else 0

    def _push(self, block_hash: int, entry: IndexEntry) -> None:
        heapq.heappush(self._heap, (self._priority(entry), entry.last_use, block_hash))
        if len(self._heap) > 4 * len(self.entries) + 64:
            self._compact()

    def _pop_victim(self) -> int | None:
        """The next evictable block in policy order. Stale slots (touched since, removed) and
        blocks that are not evictable now are dropped; they are pushed again when they
        become evictable (unpin, last child gone)."""
        while self._heap:
            primary, last_use, block_hash = heapq.heappop(self._heap)
            entry = self.entries.get(block_hash)
            if entry is None or entry.last_use != last_use or self._priority(entry) != primary:
                continue
            if self.evictable(block_hash):
                return block_hash
        return None

    def _compact(self) -> None:
        self._heap = [(self._priority(e), e.last_use, h) for h, e in self.entries.items()]
        heapq.heapify(self._heap)
