"""Per-sequence KV block tables on top of the block pool: the scheduler's whole view of KV.

The scheduler asks three things: which prefix of a request is already cached
(`find_cached_prefix`), whether there is room for the next tokens
(`allocate`, a plain False when not), and to release a request (`free`).
After each step it reports how far each request has been computed
(`cache_computed`), so newly filled blocks enter the prefix cache only once
their KV really exists.

With a `TierSource` (tiers below the device pool), `find_cached_prefix` extends
the device hits by the run the tiers hold, and `allocate` onboards it: fresh
blocks get the payloads and enter the prefix cache before the step, and the
prefix shrinks to what really loaded. Nothing is onboarded when allocation fails.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.kv.block_pool import BlockPool, KVBlock
from tokenmill.kv.hashing import DEFAULT_SEED, block_hashes


class TierSource(Protocol):
    """Blocks below the device pool (engine/kv_tiers_wiring.py implements it over the tiers)."""

    def lookup(self, hashes: Sequence[int]) -> int:
        """How many leading `hashes` the tiers hold (presence only)."""
        ...

    def load_into(self, blocks: Sequence[KVBlock], hashes: Sequence[int],
                  tokens: Sequence[Sequence[int]]) -> int:
        """Fill `blocks` with the verified KV of the leading run of `hashes`; the run's length."""
        ...


@dataclass(slots=True)
class CachedPrefix:
    blocks: list[KVBlock]
    num_tokens: int  # device hits plus the tier run still to onboard (shrinks if loading falls short)
    num_queried_tokens: int = 0
    onboard_hashes: list[int] = field(default_factory=list)  # the tier run after `blocks`
    onboard_tokens: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def num_onboard_blocks(self) -> int:
        return len(self.onboard_hashes)


@dataclass(slots=True)
class _SeqKV:
    blocks: list[KVBlock] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of the filled blocks
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    extra_key: str | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0  # device prefix-cache hits
    onboarded_tokens: int = 0  # tokens loaded from tiers below the device pool

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, pool: BlockPool, hash_seed: int = DEFAULT_SEED, tiers: TierSource | None = None) -> None:
        self.pool = pool
        self.tiers = tiers
        self.block_size = pool.block_size
        self.hash_seed = hash_seed
        self._seqs: dict[str, _SeqKV] = {}
        self.stats = PrefixCacheStats()

    def find_cached_prefix(
        self, request_id: str, token_ids: Sequence[int], extra_key: str | None = None
    ) -> CachedPrefix:
        """Longest cached run of leading full blocks, leaving at least one token to compute
        (the last position's logits are needed to sample)."""
        seq = self._seqs.setdefault(request_id, _SeqKV(extra_key=extra_key))
        if not self.pool.enable_caching:
            return CachedPrefix([], 0)
        self._extend_hashes(seq, token_ids)
        max_blocks = (len(token_ids) - 1) // self.block_size
        bs = self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(seq.hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        cached = CachedPrefix(hits, len(hits) * bs, len(token_ids))
        if self.tiers is not None and len(hits) < max_blocks:
            run = self.tiers.lookup(seq.hashes[len(hits):max_blocks])
            cached.onboard_hashes = seq.hashes[len(hits):len(hits) + run]
            cached.onboard_tokens = [tuple(token_ids[i * bs:(i + 1) * bs]) for i in range(len(hits), len(hits) + run)]
            cached.num_tokens += run * bs
        return cached

    def allocate(
        self, request_id: str, num_tokens_total: int, cached: CachedPrefix | None = None
    ) -> bool:
        """Ensure blocks for the first `num_tokens_total` tokens; take `cached` hits first.

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        seq = self._seqs.setdefault(request_id, _SeqKV())
        hits = cached.blocks if cached else []
        need = -(-num_tokens_total // self.block_size) - len(seq.blocks) - len(hits)
        # Hits that sit in the free queue stop being allocatable once touched.
        hits_in_free = sum(1 for b in hits if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - hits_in_free:
            return False
        if cached is not None:
            self.stats.queried_tokens += cached.num_queried_tokens
            self.stats.hit_tokens += len(hits) * self.block_size
        if hits:
            self.pool.touch(hits)
            seq.blocks.extend(hits)
            seq.num_cached_blocks = len(seq.blocks)
        if need > 0:
            fresh = self.pool.allocate(need)
            if fresh is None:  # cannot happen after the check above; keep state consistent anyway
                return False
            seq.blocks.extend(fresh)
            if cached is not None and cached.num_onboard_blocks:
                self._onboard(seq, cached, fresh)
        return True

    def _onboard(self, seq: _SeqKV, cached: CachedPrefix, fresh: list[KVBlock]) -> None:
        """Load the tier run into the first fresh blocks and register what loaded."""
        start, bs = len(cached.blocks), self.block_size
        want = min(cached.num_onboard_blocks, len(fresh))
        hashes, tokens = cached.onboard_hashes[:want], cached.onboard_tokens[:want]
        loaded = self.tiers.load_into(fresh[:want], hashes, tokens) if self.tiers is not None else 0
        if loaded:
            parent = seq.hashes[start - 1] if start > 0 else None
            self.pool.cache_blocks(fresh[:loaded], hashes[:loaded], tokens[:loaded], parent)
            seq.num_cached_blocks = start + loaded
        cached.num_tokens -= (cached.num_onboard_blocks - loaded) * bs
        del cached.onboard_hashes[loaded:], cached.onboard_tokens[loaded:]
        self.stats.onboarded_tokens += loaded * bs

    def cache_computed(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the request's blocks that `num_computed` tokens have filled."""
        seq = self._seqs.get(request_id)
        if seq is None or not self.pool.enable_caching:
            return
        num_full = min(num_computed // self.block_size, len(seq.blocks))
        if num_full <= seq.num_cached_blocks:
            return
        self._extend_hashes(seq, token_ids[:num_full * self.block_size])
        start, bs = seq.num_cached_blocks, self.block_size
        parent = seq.hashes[start - 1] if start > 0 else None
        tokens = [token_ids[i * bs:(i + 1) * bs] for i in range(start, num_full)]
        self.pool.cache_blocks(seq.blocks[start:num_full], seq.hashes[start:num_full], tokens, parent)
        seq.num_cached_blocks = num_full

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first (children evicted before parents)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(reversed(seq.blocks))

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past its first `num_tokens` positions (those it took for
        speculative tokens that were rejected), tail first. Cached blocks are never past them."""
        seq = self._seqs.get(request_id)
        keep = -(-num_tokens // self.block_size)
        if seq is None or len(seq.blocks) <= keep:
            return
        tail = seq.blocks[keep:]
        del seq.blocks[keep:]
        self.pool.free(reversed(tail))

    def block_ids(self, request_id: str) -> list[int]:
        seq = self._seqs.get(request_id)
        return [b.block_id for b in seq.blocks] if seq else []

    def block_hashes(self, request_id: str) -> list[int]:
        seq = self._seqs.get(request_id)
        return list(seq.hashes) if seq else []

    def num_live_requests(self) -> int:
        return len(self._seqs)

    def _extend_hashes(self, seq: _SeqKV, token_ids: Sequence[int]) -> None:
        bs = self.block_size
        have = len(seq.hashes)
        if len(token_ids) // bs <= have:
            return
        parent = seq.hashes[-1] if have else None
        seq.hashes.extend(block_hashes(
            token_ids[have * bs:], bs, self.hash_seed,
            extra_key=seq.extra_key if have == 0 else None, parent=parent,
        ))
