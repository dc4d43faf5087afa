"""`DiskTier`: KV blocks as files in a local directory, one self-verifying record per block.

Why one file per block rather than one preallocated file with slots: a rename is
the only atomic commit a POSIX file system gives for free, so a block is written
to a unique temp file, fsynced, then renamed to `<root>/<hh>/<hash:016x>.blk`;
the final name only ever names a complete record. No slot allocator or free
list has to be recovered after a crash, the index is rebuilt by walking the
directory, and the same layout serves a directory shared by several processes
and hosts (`SharedDirTier`), where slot allocation would need a distributed lock.
Blocks are tens of KB and up, so an inode per block is cheap.

On start the index is rebuilt from the files: temp files left by a crash are
removed, and every record is read back and verified (checksums, length); one
that does not verify is deleted. Older files are indexed first, so LRU order
survives a restart approximately.
"""
from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from tokenmill.kv.events import KVEventEmitter
from tokenmill.kv.tiers.base import BlockMeta
from tokenmill.kv.tiers.indexed import IndexedTier
from tokenmill.kv.tiers.record import CorruptBlock, decode_record, encode_record

log = logging.getLogger(__name__)

BLOCK_SUFFIX = ".blk"
TEMP_SUFFIX = ".tmp"


class DiskTier(IndexedTier[bytes]):
    def __init__(
        self, root: str | os.PathLike[str], capacity_bytes: int, *, policy: str = "lru",
        max_pinned: int = 4096, fsync: bool = True, events: KVEventEmitter | None = None,
        name: str = "disk",
    ) -> None:
        super().__init__(name, capacity_bytes, policy=policy, max_pinned=max_pinned, events=events)
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        self.rebuild_index()

    def block_path(self, block_hash: int) -> Path:
        name = f"{block_hash & ((1 << 64) - 1):016x}"
        return self.root / name[:2] / (name + BLOCK_SUFFIX)

    def rebuild_index(self) -> int:
        """Index every verifying block file under the root; returns how many were indexed.
        Blocks that no longer fit the capacity are evicted as usual (children first)."""
        self._remove_stale_temps()
        found: list[tuple[float, int, int, int | None]] = []
        for path in self.root.glob(f"??/*{BLOCK_SUFFIX}"):
            entry = self._verify_file(path)
            if entry is not None:
                found.append(entry)
        found.sort()
        indexed = 0
        for _, block_hash, size, parent in found:
            with self._lock:
                if block_hash in self.index:
                    continue
                admission = self.index.admit(block_hash, size, parent)
            self._give_up(admission.evicted)
            indexed += admission.admitted
        log.info("%s tier at %s: %d blocks indexed (%d bytes)", self.name, self.root, indexed, self.used_bytes)
        return indexed

    def _verify_file(self, path: Path) -> tuple[float, int, int, int | None] | None:
        """(mtime, hash, size, parent) of a block file that verifies; deletes one that does not."""
        try:
            block_hash = int(path.name[:-len(BLOCK_SUFFIX)], 16)
            record = path.read_bytes()
            _, meta = decode_record(block_hash, record)
            return path.stat().st_mtime, block_hash, len(record), meta.parent
        except (ValueError, CorruptBlock) as exc:
            log.warning("%s tier: removing unverifiable block file %s (%s)", self.name, path, exc)
            self.stats.corrupt += 1
            path.unlink(missing_ok=True)
        except OSError as exc:  # vanished meanwhile, or unreadable: skip it
            log.warning("%s tier: cannot read %s: %s", self.name, path, exc)
        return None

    def _remove_stale_temps(self) -> None:
        for path in self.root.glob(f"??/*{TEMP_SUFFIX}"):
            if self._temp_is_abandoned(path):
                path.unlink(missing_ok=True)

    def _temp_is_abandoned(self, path: Path) -> bool:
        """A local disk has one writer: the process that starts the tier, so any temp is left over."""
        return True

    def _prepare(self, block_hash: int, payload: bytes, meta: BlockMeta) -> tuple[bytes, int]:
        record = encode_record(block_hash, payload, meta)
        return record, len(record)

    def _write(self, block_hash: int, prepared: bytes) -> bool:
        final = self.block_path(block_hash)
        temp = final.with_name(f".{final.stem}.{os.getpid()}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")
        try:
            final.parent.mkdir(exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(prepared)
                    out.flush()
                    if self.fsync:  # the rename must never be durable before the bytes are
                        os.fsync(out.fileno())
                os.replace(temp, final)
            finally:
                temp.unlink(missing_ok=True)
            return True
        except OSError as exc:
            log.warning("%s tier: writing block %#x failed: %s", self.name, block_hash, exc)
            return False

    def _read(self, block_hash: int) -> tuple[bytes, BlockMeta] | None:
        try:
            record = self.block_path(block_hash).read_bytes()
        except FileNotFoundError:
            return None
        return decode_record(block_hash, record)

    def _erase(self, block_hash: int) -> None:
        try:
            self.block_path(block_hash).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("%s tier: removing block %#x failed: %s", self.name, block_hash, exc)
