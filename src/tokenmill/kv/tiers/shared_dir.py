"""`SharedDirTier`: the `shared` tier on a directory several processes or hosts mount (NFS, a
parallel file system, a local directory shared by the workers of one box).

Same files as `DiskTier`, with what concurrency adds:
- Writers of the same hash race harmlessly: each writes its own uniquely named
  temp file and renames it over the final name; chained hashes name identical
  content, and a rename is atomic, so a reader sees one complete record or none.
  A writer that finds the file already there skips the write.
- Blocks written by others are found on demand: `contains`/`get` fall back to
  the file system for hashes this process has not indexed, and adopt them.
  `refresh()` rescans the whole directory.
- Another process may delete a file this one indexed: the read is then a
  counted miss and the entry is dropped.
- Temp files are only removed once older than `stale_temp_seconds`, since a
  fresh one may be another writer's work in progress.

Capacity is enforced on this process's view of the directory (its own writes
plus what it adopted), so with N writers the directory can briefly hold up to N
budgets between refreshes; give each worker `capacity / N` when that matters.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from tokenmill.kv.events import KVEventEmitter
from tokenmill.kv.tiers.base import BlockMeta
from tokenmill.kv.tiers.disk import DiskTier
from tokenmill.kv.tiers.record import CorruptBlock, decode_record


class SharedDirTier(DiskTier):
    def __init__(
        self, root: str | os.PathLike[str], capacity_bytes: int, *, policy: str = "lru",
        max_pinned: int = 4096, fsync: bool = True, stale_temp_seconds: float = 600.0,
        events: KVEventEmitter | None = None,
    ) -> None:
        self.stale_temp_seconds = stale_temp_seconds
        super().__init__(root, capacity_bytes, policy=policy, max_pinned=max_pinned, fsync=fsync,
                         events=events, name="shared")

    def refresh(self) -> int:
        """Adopt blocks other writers stored since the last scan; returns the count indexed."""
        return self.rebuild_index()

    def contains(self, block_hash: int) -> bool:
        return super().contains(block_hash) or self.block_path(block_hash).is_file()

    def contains_many(self, hashes: Sequence[int]) -> list[bool]:
        return [self.contains(h) for h in hashes]

    def get(self, block_hash: int) -> tuple[bytes, BlockMeta] | None:
        if not super().contains(block_hash):
            self._adopt(block_hash)
        return super().get(block_hash)

    def _adopt(self, block_hash: int) -> None:
        """Index a block another writer put here, if its file verifies."""
        path = self.block_path(block_hash)
        try:
            record = path.read_bytes()
        except OSError:
            return
        found = self._read_verified_record(block_hash, record)
        if found is None:
            return
        with self._lock:
            if block_hash in self.index:
                return
            admission = self.index.admit(block_hash, len(record), found.parent)
        self._give_up(admission.evicted)
        if admission.admitted and self.events is not None:
            self.events.stored(self.name, found.parent, [block_hash])

    def _read_verified_record(self, block_hash: int, record: bytes) -> BlockMeta | None:
        """Writers rename only complete records into place, so one that does not verify is
        damaged for good: count it and delete it (a later put can then store it again)."""
        try:
            return decode_record(block_hash, record)[1]
        except CorruptBlock:
            self.stats.corrupt += 1
            self._erase(block_hash)
            return None

    def _write(self, block_hash: int, prepared: bytes) -> bool:
        if self.block_path(block_hash).is_file():
            return True  # another writer stored the same chained hash, i.e. the same content
        return super()._write(block_hash, prepared)

    def _temp_is_abandoned(self, path: Path) -> bool:
        try:
            return time.time() - path.stat().st_mtime > self.stale_temp_seconds
        except OSError:
            return False
