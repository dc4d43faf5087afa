"""Several block pools of one worker announced as one (the pools of attention data-parallel
ranks): a router sees what the worker holds in any of them, and the worker places a request on
the rank that holds its prefix.

Invariant: a hash is announced stored once some pool holds it, and removed only when the last
pool that held it lets it go, so the worker's event stream never says a prefix is gone while a
rank can still serve it.
"""
from __future__ import annotations

from tokenmill.kv.events import KVEventEmitter


class UnionEvents:
    def __init__(self, emitter: KVEventEmitter) -> None:
        self.emitter = emitter
        self._holders: dict[tuple[str, int], set[int]] = {}  # (tier, hash) -> pools holding it

    def view(self, pool: int) -> PoolEvents:
        """What pool number `pool` reports its events to (in place of the worker's emitter)."""
        return PoolEvents(self, pool)

    def stored(self, pool: int, tier: str, parent: int | None, hashes: list[int]) -> None:
        for h in hashes:
            self._holders.setdefault((tier, h), set()).add(pool)
        self.emitter.stored(tier, parent, hashes)  # the run whole, so its chain stays contiguous

    def removed(self, pool: int, tier: str, hashes: list[int]) -> None:
        gone = []
        for h in hashes:
            holders = self._holders.get((tier, h))
            if holders is None:
                continue
            holders.discard(pool)
            if not holders:
                del self._holders[(tier, h)]
                gone.append(h)
        self.emitter.removed(tier, gone)

    def cleared(self, pool: int) -> None:
        by_tier: dict[str, list[int]] = {}
        for (tier, h), holders in self._holders.items():
            if pool in holders:
                by_tier.setdefault(tier, []).append(h)
        for tier, hashes in by_tier.items():
            self.removed(pool, tier, hashes)


class PoolEvents(KVEventEmitter):
    """One pool's side of a `UnionEvents`: the emitter interface a `BlockPool` calls."""

    def __init__(self, union: UnionEvents, pool: int) -> None:
        super().__init__(union.emitter.worker)
        self.union, self.pool = union, pool

    def stored(self, tier: str, parent: int | None, hashes: list[int]) -> None:
        if hashes:
            self.union.stored(self.pool, tier, parent, hashes)

    def removed(self, tier: str, hashes: list[int]) -> None:
        if hashes:
            self.union.removed(self.pool, tier, hashes)

    def cleared(self) -> None:
        self.union.cleared(self.pool)
