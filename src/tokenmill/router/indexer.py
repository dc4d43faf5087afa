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

Not thread-safe: call it from one thread (the frontend's event loop).
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import not_

from tokenmill.kv.events import TIERS, KVEvent
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
    blocks: dict[str, set[int]]
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
        if event_id <= state.last_event_id:
            if event_id != 0:
                self.stale_events += 1
                return ApplyStatus.STALE
            self._drop_blocks(state)  # the worker restarted and numbers from 0 again
            state.awaiting_snapshot, state.buffered = False, []
        status = ApplyStatus.APPLIED
        if state.awaiting_snapshot:
            if len(state.buffered) < self.max_buffered_events:
                state.buffered.append(event)
            status = ApplyStatus.AWAITING_SNAPSHOT
        elif event_id > state.last_event_id + 1:
            self.gaps_detected += 1
            state.awaiting_snapshot, state.buffered = True, [event]
            status = ApplyStatus.GAP
        state.last_event_id = event_id
        self._apply_change(state, event)
        self.events_applied += 1
        return status

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
        """A copy of tier -> hashes the index holds for `worker`."""
        state = self._workers.get(worker)
        return {} if state is None else {tier: set(s) for tier, s in state.blocks.items() if s}

    def num_blocks(self) -> int:
        """Index size: (worker, tier, block) entries."""
        return sum(len(s) for state in self._workers.values() for s in state.blocks.values())

    def num_hashes(self) -> int:
        """Distinct (tier, block) keys."""
        return sum(len(holders) for holders in self._holders.values())

    # ---- internals ----------------------------------------------------------------------

    def _add_worker(self, worker: str) -> _WorkerState:
        slot = self._slots.assign(worker)
        state = _WorkerState(slot, 1 << slot, {tier: set() for tier in TIERS})
        self._workers[worker] = state
        return state

    def _apply_change(self, state: _WorkerState, event: KVEvent) -> None:
        kind = event.kind
        if kind == "stored":
            parent = event.parent  # type: ignore[union-attr]
            if parent is not None and not any(parent in s for s in state.blocks.values()):
                self.orphans += 1
            self._store(state, event.tier, event.hashes)  # type: ignore[union-attr]
        elif kind == "removed":
            self._remove(state, event.tier, event.hashes)  # type: ignore[union-attr]
        else:
            self._drop_blocks(state)

    def _store(self, state: _WorkerState, tier: str, hashes: Iterable[int]) -> None:
        held = state.blocks[tier]
        new = set(hashes)
        new -= held
        if not new:
            return  # a re-announcement: stored events are idempotent
        held |= new
        holders = self._holders[tier]
        # C-level loop: OR the worker's bit into each new block's mask
        holders.update(zip(new, map(state.bit.__or__, map(holders.get, new, repeat(0)))))

    def _remove(self, state: _WorkerState, tier: str, hashes: Iterable[int]) -> None:
        held = state.blocks[tier]
        gone = tuple(held.intersection(hashes))
        if not gone:
            return
        held.difference_update(gone)
        holders = self._holders[tier]
        masks = list(map((~state.bit).__and__, map(holders.__getitem__, gone)))
        holders.update(zip(gone, masks))
        if 0 in masks:
            for block_hash in compress(gone, map(not_, masks)):
                del holders[block_hash]

    def _drop_blocks(self, state: _WorkerState) -> None:
        for tier, held in state.blocks.items():
            if held:
                self._remove(state, tier, list(held))
