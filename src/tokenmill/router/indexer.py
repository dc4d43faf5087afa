"""The global KV index: which worker holds which block, in which tier, built from KV events.

Feed it every worker's events in the order each worker published them:

    status = indexer.apply(event)                 # kv.events.BlockStored / BlockRemoved / AllCleared
    if status is ApplyStatus.GAP:                 # ids jumped: events of that worker were lost
        ask event.worker for a snapshot, then:
        indexer.apply_snapshot(worker, {"device": [...], "host": [...]}, last_event_id)
        (returns GAP again if the events buffered meanwhile still do not connect: ask again)
    matches = indexer.match(request_hashes)       # {worker: {tier: blocks}}

Contract of `match`: for each worker, the longest run of the request's leading blocks
that the worker holds in *some* tier, split by tier; a block held in several tiers counts
once, in the first of `tier_preference` (device, host, disk, shared by default). Workers
holding no leading block are absent. Chained hashes encode their prefix, so the index is
flat (hash -> worker bitmask per tier): a stored block "attaches under its parent" in the
sense that `match` reaches it only through its parent. A stored event whose parent the
worker does not hold is still indexed (its parent may follow) and counted in `orphans`.

Event ids are checked per worker (each worker's ids start at 0 and rise by one across all
its tiers). An id at or below the last applied is ignored (STALE), except 0, which means
the worker restarted: its part is dropped and rebuilt from its new events. On a jump the
event is applied anyway (best effort) and the worker is marked as awaiting a snapshot;
its later events are applied and buffered (up to `max_buffered_events`) so the snapshot,
taken at `last_event_id`, can be brought up to date by replaying the newer ones.
A snapshot must be taken atomically with the worker's last event id (e.g. on the engine
thread between steps: `BlockPool.cached_hashes()` and `KVEventEmitter.last_event_id`).

Costs: an in-order event is a few dict operations per block (no per-block objects); a
match is one lookup per block plus bookkeeping only where the set of holders changes.
Per worker only counts are kept, so `cleared`, `remove_worker` and a snapshot scan the
whole index once (O(index), ~0.1 s at a million blocks): rare events, kept off the hot paths.

Not thread-safe: call it from one thread (the frontend's event loop).
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tokenmill.kv.events import TIERS, BlockRemoved, BlockStored, KVEvent
from tokenmill.router.prefix_walk import WorkerSlots, walk_one_tier, walk_tiers

WorkerMatches = dict[str, dict[str, int]]  # worker -> tier -> leading blocks held there


class ApplyStatus(enum.Enum):
    APPLIED = "applied"                  # in order
    STALE = "stale"                      # id already seen (a duplicate); ignored
    GAP = "gap"                          # ids jumped: request a snapshot from the worker now
    AWAITING_SNAPSHOT = "awaiting"       # applied and buffered; a snapshot is already due
    IGNORED = "ignored"                  # (Router only) from a worker it does not route to


@dataclass(slots=True)
class _WorkerState:
    slot: int
    bit: int
    counts: dict[str, int]  # tier -> blocks held (kept exact by the bit checks)
    last_event_id: int = -1
    awaiting_snapshot: bool = False
    buffered: list[KVEvent] = field(default_factory=list)


class KVIndexer:
    def __init__(self, tier_preference: Sequence[str] = TIERS, max_buffered_events: int = 100_000) -> None:
        if sorted(tier_preference) != sorted(TIERS):
            raise ValueError(f"tier_preference must order exactly the tiers {TIERS}, got {tier_preference}")
        if max_buffered_events < 0:
            raise ValueError(f"max_buffered_events must be >= 0, got {max_buffered_events}")
        self.tier_preference = tuple(tier_preference)
        self.max_buffered_events = max_buffered_events
        self._holders: dict[str, dict[int, int]] = {tier: {} for tier in self.tier_preference}
        self._workers: dict[str, _WorkerState] = {}
        self._slots = WorkerSlots()
        self.events_applied = 0
        self.stale_events = 0
        self.gaps_detected = 0
        self.gaps_recovered = 0
        self.orphans = 0

    # ---- events -------------------------------------------------------------------------

    def apply(self, event: KVEvent) -> ApplyStatus:
        state = self._workers.get(event.worker) or self._add_worker(event.worker)
        event_id = event.event_id
        status = ApplyStatus.APPLIED
        if event_id != state.last_event_id + 1 or state.awaiting_snapshot:
            status = self._check_order(state, event)
            if status is ApplyStatus.STALE:
                return status
        state.last_event_id = event_id
        self._apply_change(state, event)
        self.events_applied += 1
        return status

    def _check_order(self, state: _WorkerState, event: KVEvent) -> ApplyStatus:
        """The slow path of `apply`: duplicates, restarts, gaps, events while awaiting a snapshot."""
        if event.event_id <= state.last_event_id:
            if event.event_id != 0:
                self.stale_events += 1
                return ApplyStatus.STALE
            self._drop_blocks(state)  # the worker restarted and numbers from 0 again
            state.awaiting_snapshot, state.buffered, state.last_event_id = False, [], -1
        if state.awaiting_snapshot:
            if len(state.buffered) < self.max_buffered_events:
                state.buffered.append(event)
            return ApplyStatus.AWAITING_SNAPSHOT
        if event.event_id > state.last_event_id + 1:
            self.gaps_detected += 1
            state.awaiting_snapshot, state.buffered = True, [event]
            return ApplyStatus.GAP
        return ApplyStatus.APPLIED

    def apply_snapshot(self, worker: str, tier_hashes: Mapping[str, Iterable[int]],
                       last_event_id: int) -> ApplyStatus:
        """Replace `worker`'s part with a snapshot taken at `last_event_id`, then replay the
        events buffered since the gap. GAP: they still do not connect, ask for another;
        STALE: an unrequested snapshot older than the events already applied, ignored."""
        unknown = set(tier_hashes) - set(TIERS)
        if unknown:
            raise ValueError(f"snapshot of {worker!r} names unknown tiers {sorted(unknown)}")
        state = self._workers.get(worker) or self._add_worker(worker)
        if not state.awaiting_snapshot and last_event_id < state.last_event_id:
            return ApplyStatus.STALE
        recovering = state.awaiting_snapshot
        newer = [e for e in state.buffered if e.event_id > last_event_id]
        self._drop_blocks(state)
        for tier, hashes in tier_hashes.items():
            self._store(state, tier, hashes)
        state.last_event_id, state.awaiting_snapshot, state.buffered = last_event_id, False, []
        for position, event in enumerate(newer):
            if event.event_id != state.last_event_id + 1:
                state.awaiting_snapshot, state.buffered = True, newer[position:]
                for later in state.buffered:  # keep what they say until the next snapshot
                    self._apply_change(state, later)
                state.last_event_id = newer[-1].event_id
                return ApplyStatus.GAP
            state.last_event_id = event.event_id
            self._apply_change(state, event)
        self.gaps_recovered += recovering
        return ApplyStatus.APPLIED

    def remove_worker(self, worker: str) -> None:
        """Forget everything of a worker that left (a no-op for an unknown one)."""
        state = self._workers.pop(worker, None)
        if state is None:
            return
        self._drop_blocks(state)
        self._slots.release(worker)

    # ---- queries ------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> WorkerMatches:
        """worker -> {tier: blocks} of the request's leading blocks it holds (see module doc)."""
        used = [(tier, holders) for tier, holders in self._holders.items() if holders]
        worker_at = self._slots.worker_at
        if len(used) == 1:
            tier = used[0][0]
            lengths = walk_one_tier(hashes, used[0][1].get)
            return {worker_at[slot]: {tier: length} for slot, length in lengths.items()}
        counts = walk_tiers(hashes, [holders.get for _, holders in used])
        return {worker_at[slot]: {used[i][0]: n for i, n in enumerate(per_tier) if n}
                for slot, per_tier in counts.items()}

    def workers(self) -> list[str]:
        return list(self._workers)

    def awaiting_snapshot(self) -> list[str]:
        """Workers whose part is best-effort until their snapshot arrives (re-ask on a timeout)."""
        return [name for name, state in self._workers.items() if state.awaiting_snapshot]

    def last_event_id(self, worker: str) -> int:
        state = self._workers.get(worker)
        return -1 if state is None else state.last_event_id

    def worker_blocks(self, worker: str) -> dict[str, set[int]]:
        """tier -> hashes the index holds for `worker` (scans the index: for tests and debugging)."""
        state = self._workers.get(worker)
        if state is None:
            return {}
        found = {tier: self._scan(tier, state.bit) for tier in TIERS}
        return {tier: set(hashes) for tier, hashes in found.items() if hashes}

    def blocks_by_worker(self) -> dict[str, dict[str, list[int]]]:
        """worker -> tier -> the hashes the index holds for it, in one scan per tier (O(index):
        for the admin index view and tests, never on a hot path)."""
        out: dict[str, dict[str, list[int]]] = {name: {} for name in self._workers}
        owners = [(state.bit, out[name]) for name, state in self._workers.items()]
        for tier, holders in self._holders.items():
            for block_hash, mask in holders.items():
                for bit, tiers in owners:
                    if mask & bit:
                        tiers.setdefault(tier, []).append(block_hash)
        return out

    def num_blocks(self) -> int:
        """Index size: (worker, tier, block) entries."""
        return sum(sum(state.counts.values()) for state in self._workers.values())

    def num_hashes(self) -> int:
        """Distinct (tier, block) keys."""
        return sum(len(holders) for holders in self._holders.values())

    # ---- internals ----------------------------------------------------------------------

    def _add_worker(self, worker: str) -> _WorkerState:
        slot = self._slots.assign(worker)
        state = _WorkerState(slot, 1 << slot, dict.fromkeys(TIERS, 0))
        self._workers[worker] = state
        return state

    def _apply_change(self, state: _WorkerState, event: KVEvent) -> None:
        kind = type(event)
        if kind is BlockStored:
            parent, tier = event.parent, event.tier  # type: ignore[union-attr]
            if parent is not None and not self._holders[tier].get(parent, 0) & state.bit \
                    and not any(holders.get(parent, 0) & state.bit for holders in self._holders.values()):
                self.orphans += 1
            self._store(state, tier, event.hashes)  # type: ignore[union-attr]
        elif kind is BlockRemoved:
            self._remove(state, event.tier, event.hashes)  # type: ignore[union-attr]
        else:
            self._drop_blocks(state)

    # Per-block loops over one big dict: the bit test makes both idempotent and keeps the
    # per-worker counts exact; no per-worker sets, because every extra structure touched
    # per block is another cache miss on a million-entry index.
    def _store(self, state: _WorkerState, tier: str, hashes: Iterable[int]) -> None:
        holders = self._holders[tier]
        get, bit, added = holders.get, state.bit, 0
        for block_hash in hashes:
            mask = get(block_hash, 0)
            if not mask:
                holders[block_hash] = bit  # the one shared int object: no allocation, stays in cache
                added += 1
            elif not mask & bit:
                holders[block_hash] = mask | bit
                added += 1
        state.counts[tier] += added

    def _remove(self, state: _WorkerState, tier: str, hashes: Iterable[int]) -> None:
        holders = self._holders[tier]
        get, bit, removed = holders.get, state.bit, 0
        for block_hash in hashes:
            mask = get(block_hash, 0)
            if mask & bit:
                mask ^= bit
                if mask:
                    holders[block_hash] = mask
                else:
                    del holders[block_hash]
                removed += 1
        state.counts[tier] -= removed

    def _drop_blocks(self, state: _WorkerState) -> None:
        """Everything of one worker: a scan of the index, O(index size), for the rare events
        (cleared, a worker leaving, a snapshot) so that the per-event paths stay lean."""
        for tier, count in state.counts.items():
            if count:
                self._remove(state, tier, self._scan(tier, state.bit))

    def _scan(self, tier: str, bit: int) -> list[int]:
        return [block_hash for block_hash, mask in self._holders[tier].items() if mask & bit]
