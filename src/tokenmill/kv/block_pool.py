"""The device block pool: every KV block, its reference count, and the prefix cache.

Invariants:
- A block is in the free queue iff its `ref_cnt` is 0. Free blocks that still hold
  a hash stay reusable (a prefix-cache hit takes them back) until evicted.
- The free queue is LRU: allocation takes from the front; freed blocks go to the
  back. Callers free a sequence's blocks tail first, so a chain's children are
  always evicted before their parent.
- `cached[h]` is the one block holding the KV of chained hash `h`; a block holds at
  most one hash and keeps its token ids, so a hash collision is caught on lookup.
- Allocation failure is a plain `None`, never an exception.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tokenmill.kv.events import KVEventEmitter


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None  # the chained hash of the block before it (None for block 0)
    token_ids: tuple[int, ...] | None = None


EvictionHook = Callable[[list[KVBlock]], None]


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        events: KVEventEmitter | None = None,
        enable_caching: bool = True,
        tier: str = "device",
        on_evict: EvictionHook | None = None,
    ) -> None:
        """`on_evict` sees cached blocks about to be reused, hash and token ids still set and
        their KV still intact (a tiered manager copies them out here)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.events = events
        self.enable_caching = enable_caching
        self.tier = tier
        self.on_evict = on_evict

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for `block_hash`, if its stored tokens really are `token_ids`."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock] | None:
        """`n` fresh blocks with ref_cnt 1, evicting the least recently freed; None if too few."""
        if n > len(self.free_queue):
            return None
        out = [self.free_queue.popitem(last=False)[1] for _ in range(n)]
        evicted = [block for block in out if block.block_hash is not None]
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        if evicted and self.events is not None:
            self.events.removed(self.tier, [block.block_hash for block in evicted])
        for block in out:
            self._uncache(block)
            block.ref_cnt = 1
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given (pass tail first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_blocks(
        self, blocks: Sequence[KVBlock], hashes: Sequence[int], tokens: Sequence[Sequence[int]],
        parent: int | None,
    ) -> None:
        """Register newly filled blocks under their chained hashes and announce them."""
        if not self.enable_caching:
            return
        registered = False
        parents = [parent, *hashes[:-1]]
        for block, block_hash, block_parent, block_tokens in zip(blocks, hashes, parents, tokens, strict=True):
            if block.block_hash is not None or block_hash in self.cached:
                continue  # already cached (shared prefix) or a duplicate computed in parallel
            block.block_hash, block.parent_hash = block_hash, block_parent
            block.token_ids = tuple(block_tokens)
            self.cached[block_hash] = block
            registered = True
        # The whole run is announced so the event's chain stays contiguous from `parent`;
        # re-announcing a hash the router already knows is harmless.
        if registered and self.events is not None:
            self.events.stored(self.tier, parent, list(hashes))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            self._uncache(block)
        if self.events is not None:
            self.events.cleared()
        return True

    def cached_hashes(self) -> list[int]:
        """Every hash this pool can serve (for a router's snapshot request)."""
        return list(self.cached)

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = None
