"""`TieredKVManager`: one worker's KV tiers below the device pool (host → disk → shared).

What the worker calls, and when:
- **Device eviction** (block pool hook, engine thread): `snapshot_block(kv, id)` while
  the block still holds its data, then `offload([OffloadBlock(...)])`. Offload only
  enqueues; a background thread turns snapshots into bytes and stores them. When
  more than `max_pending_blocks` wait, new offloads are dropped (counted) rather
  than blocking the engine.
- **New request** (before prefill): `lookup(hashes)` after the device prefix hit →
  `[(hash, tier), ...]`, the longest run present in the tiers. Allocate device
  blocks for it, `load(hashes, block_tokens)` → payloads of the longest run that
  verifies (may be *shorter* than the lookup: a block can be evicted or found
  corrupt in between), `write_block_payload` each, then register the blocks in the
  device prefix cache. Blocks beyond the loaded run are computed.
- **Pinning**: `pin(hashes)` / `unpin(hashes)` (a system prompt, a corpus).
- **Metrics**: `stats()`; **snapshots** for routers: `cached_hashes()`.
- **Shutdown**: `close()`; tests call `drain()` to wait for the offload thread.

Policy: offloads go to host (or straight to disk when there is no host tier). A
block leaves host for disk only if it was used at least `disk_min_uses` times
while in host (puts plus hits): one-off prompts never churn the disk. The shared
tier is written for every offload when `write_through`, and for pinned hashes
always. Tiers emit their own tier-tagged KV events through `events`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tokenmill.kv.events import KVEventEmitter
from tokenmill.kv.tiers.base import BlockMeta, Tier
from tokenmill.kv.tiers.indexed import IndexedTier
from tokenmill.kv.tiers.payload import block_payload

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OffloadBlock:
    """A block leaving the device pool: its chain position, tokens and KV (a snapshot tensor or
    bytes)."""
    block_hash: int
    parent: int | None
    token_ids: tuple[int, ...]
    payload: bytes | torch.Tensor


@dataclass(slots=True)
class ManagerStats:
    offload_enqueued: int = 0
    offload_dropped: int = 0  # refused because the queue was full
    offload_stored: int = 0
    offload_seconds: float = 0.0  # background time spent storing, summed
    onboard_requests: int = 0
    onboard_blocks: int = 0
    onboard_seconds: float = 0.0
    token_mismatch: int = 0  # a stored block whose tokens differ (hash collision): a miss


class TieredKVManager:
    def __init__(
        self, host: Tier | None = None, disk: Tier | None = None, shared: Tier | None = None, *,
        events: KVEventEmitter | None = None, write_through: bool = False, disk_min_uses: int = 2,
        max_pending_blocks: int = 1024,
    ) -> None:
        if disk_min_uses < 1 or max_pending_blocks < 1:
            raise ValueError("disk_min_uses and max_pending_blocks must be >= 1")
        self.host, self.disk, self.shared = host, disk, shared
        self.tiers: list[Tier] = [t for t in (host, disk, shared) if t is not None]
        for tier in self.tiers:
            if events is not None:
                tier.events = events
        if isinstance(host, IndexedTier):
            host.on_evict = self._demote_from_host
        self.write_through = write_through
        self.disk_min_uses = disk_min_uses
        self.max_pending_blocks = max_pending_blocks
        self.stats_counters = ManagerStats()
        self._pinned: set[int] = set()
        self._pending = 0
        self._lock = threading.Lock()
        self._jobs: queue.Queue[list[OffloadBlock] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._worker.start()

    # -- offload (engine thread enqueues, background thread stores) -----------------------
    def offload(self, blocks: Sequence[OffloadBlock]) -> bool:
        """Queue blocks evicted from the device; False (all dropped, counted) when full."""
        if not blocks:
            return True
        if not self.tiers:
            return False
        with self._lock:
            if self._pending + len(blocks) > self.max_pending_blocks:
                self.stats_counters.offload_dropped += len(blocks)
                return False
            self._pending += len(blocks)
            self.stats_counters.offload_enqueued += len(blocks)
        self._jobs.put(list(blocks))
        return True

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued offload is stored; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._jobs.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def _run(self) -> None:
        while (batch := self._jobs.get()) is not None:
            try:
                for block in batch:
                    self._store(block)
            except Exception:  # a bug must not kill the thread that keeps the engine unblocked
                log.exception("offload of %d blocks failed", len(batch))
            finally:
                with self._lock:
                    self._pending -= len(batch)
                self._jobs.task_done()
        self._jobs.task_done()

    def _store(self, block: OffloadBlock) -> None:
        start = time.perf_counter()
        first = self.host or self.disk
        to_shared = self.shared is not None and (self.write_through or block.block_hash in self._pinned)
        if not to_shared and isinstance(first, IndexedTier) and first.refresh(block.block_hash):
            # A block onboarded from this tier and evicted again (most evictions in a multi-turn
            # workload): count the use as `put` would, but skip turning the block's KV into bytes
            # again, work that otherwise competes with the prefill that caused the eviction.
            self.stats_counters.offload_stored += 1
            self.stats_counters.offload_seconds += time.perf_counter() - start
            return
        payload = block.payload if isinstance(block.payload, bytes) else block_payload(block.payload)
        meta = BlockMeta(block.parent, tuple(block.token_ids))
        stored = first.put(block.block_hash, payload, meta) if first is not None else False
        if to_shared:
            stored = self.shared.put(block.block_hash, payload, meta) or stored
        self.stats_counters.offload_stored += int(stored)
        self.stats_counters.offload_seconds += time.perf_counter() - start

    def _demote_from_host(self, block_hash: int, payload: bytes, meta: BlockMeta, uses: int) -> None:
        """Host eviction: the frequency filter between host and disk."""
        if self.disk is not None and uses >= self.disk_min_uses:
            self.disk.put(block_hash, payload, meta)

    # -- onboard (engine thread) ----------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> list[tuple[int, str]]:
        """The longest leading run of `hashes` held by some tier, with the first tier holding
        each block (host before disk before shared). Presence only: `load` verifies."""
        where: list[str | None] = [None] * len(hashes)
        for tier in self.tiers:
            todo = [i for i, w in enumerate(where) if w is None]
            if not todo:
                break
            for i, present in zip(todo, tier.contains_many([hashes[i] for i in todo]), strict=True):
                if present:
                    where[i] = tier.name
        run: list[tuple[int, str]] = []
        for block_hash, tier_name in zip(hashes, where, strict=True):
            if tier_name is None:
                break
            run.append((block_hash, tier_name))
        return run

    def load(self, hashes: Sequence[int], block_tokens: Sequence[Sequence[int]] | None = None) -> list[bytes]:
        """Payloads of the longest leading run of `hashes` that some tier returns verified
        (checksum, and the block's tokens when `block_tokens` is given)."""
        if block_tokens is not None and len(block_tokens) < len(hashes):
            raise ValueError("block_tokens must cover every hash to be loaded")
        start = time.perf_counter()
        payloads: list[bytes] = []
        for i, block_hash in enumerate(hashes):
            expected = tuple(block_tokens[i]) if block_tokens is not None else None
            payload = self._load_one(block_hash, expected)
            if payload is None:
                break
            payloads.append(payload)
        self.stats_counters.onboard_requests += 1
        self.stats_counters.onboard_blocks += len(payloads)
        self.stats_counters.onboard_seconds += time.perf_counter() - start
        return payloads

    def _load_one(self, block_hash: int, expected: tuple[int, ...] | None) -> bytes | None:
        for tier in self.tiers:
            if not tier.contains(block_hash):
                continue
            found = tier.get(block_hash)
            if found is None:
                continue
            payload, meta = found
            if expected is not None and meta.token_ids != expected:
                self.stats_counters.token_mismatch += 1
                continue
            return payload
        return None

    # -- pinning ---------------------------------------------------------------------------
    def pin(self, hashes: Iterable[int]) -> bool:
        """Pin in every tier (now or once stored); pinned blocks are written through to shared.
        False, changing nothing, when a tier's pin cap would be exceeded."""
        wanted = list(hashes)
        pinned: list[Tier] = []
        for tier in self.tiers:
            if not tier.pin(wanted):
                for done in pinned:
                    done.unpin(wanted)
                return False
            pinned.append(tier)
        self._pinned.update(wanted)
        return True

    def unpin(self, hashes: Iterable[int]) -> None:
        wanted = list(hashes)
        for tier in self.tiers:
            tier.unpin(wanted)
        self._pinned.difference_update(wanted)

    # -- observability and lifecycle ---------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per tier counters plus capacity/usage, and the manager's offload/onboard counters."""
        tiers = {t.name: {**t.stats.as_dict(), "capacity_bytes": t.capacity_bytes,
                          "used_bytes": t.used_bytes} for t in self.tiers}
        with self._lock:
            pending = self._pending
        return {"tiers": tiers, **asdict(self.stats_counters), "offload_pending": pending}

    def cached_hashes(self) -> dict[str, list[int]]:
        """Every hash per tier (a router's snapshot request)."""
        return {t.name: t.hashes() for t in self.tiers}

    def close(self) -> None:
        """Finish queued offloads, stop the thread, release the tiers."""
        self._jobs.put(None)
        self._worker.join(timeout=30)
        for tier in self.tiers:
            tier.close()
