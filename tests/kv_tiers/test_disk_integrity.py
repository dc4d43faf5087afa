"""Disk and shared-directory tiers: damaged files are counted misses, restarts rebuild the index
from verified files, and a writer killed mid-write never leaves a block that loads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kv_tiers.helpers import make_block
from tokenmill.kv.tiers.disk import DiskTier
from tokenmill.kv.tiers.shared_dir import SharedDirTier

CRASH_WRITER = """
import sys
from tokenmill.kv.tiers.disk import DiskTier
from tokenmill.kv.tiers.base import BlockMeta
tier = DiskTier(sys.argv[1], 1 << 30)
i = 0
while True:
    i += 1
    payload = bytes([i % 251]) * 200_000
    tier.put(i, payload, BlockMeta(i - 1 if i > 1 else None, (i,)))
    if i == 3:
        print("writing", flush=True)
"""

# Several processes write the same 40 hashes at once, each through its own temp file and rename.
SAME_HASH_WRITER = """
import sys
from tokenmill.kv.tiers.base import BlockMeta
from tokenmill.kv.tiers.record import encode_record
from tokenmill.kv.tiers.shared_dir import SharedDirTier
tier = SharedDirTier(sys.argv[1], 1 << 30)
for h in range(1, 41):
    tier._write(h, encode_record(h, bytes([h]) * 50_000, BlockMeta(None, (h,))))
"""


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "flip":
        raw[-1] ^= 0xFF
    elif how == "truncate":
        raw = raw[: len(raw) // 2]
    else:  # header: the stored block hash
        raw[20] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["flip", "truncate", "header"])
def test_damaged_block_is_a_counted_miss(tmp_path: Path, how: str) -> None:
    tier = DiskTier(tmp_path, 1 << 20, fsync=False)
    payload, meta = make_block(5, None, 4096)
    assert tier.put(5, payload, meta)
    _damage(tier.block_path(5), how)
    assert tier.get(5) is None
    assert tier.stats.corrupt == 1 and tier.stats.misses == 1 and tier.stats.hits == 0
    assert not tier.contains(5) and not tier.block_path(5).exists()
    assert tier.put(5, payload, meta) and tier.get(5) == (payload, meta)


def test_missing_file_is_a_miss(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, fsync=False)
    tier.put(9, *make_block(9))
    tier.block_path(9).unlink()
    assert tier.get(9) is None and tier.stats.misses == 1 and 9 not in tier.hashes()


def test_restart_rebuilds_the_index_and_drops_bad_files(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, fsync=False)
    blocks = {h: make_block(h, h - 1 if h > 1 else None, 512) for h in range(1, 9)}
    for h, (payload, meta) in blocks.items():
        tier.put(h, payload, meta)
    _damage(tier.block_path(4), "flip")
    (tier.block_path(2).parent / ".junk.123.tmp").write_bytes(b"half a block")
    reopened = DiskTier(tmp_path, 1 << 20, fsync=False)
    assert sorted(reopened.hashes()) == [1, 2, 3, 5, 6, 7, 8]
    assert reopened.stats.corrupt == 1
    assert not list(tmp_path.glob("??/*.tmp"))
    assert all(reopened.get(h) == blocks[h] for h in reopened.hashes())
    small = DiskTier(tmp_path, 3 * tier.used_bytes // 8, fsync=False)  # a smaller budget evicts on start
    assert small.used_bytes <= small.capacity_bytes and len(small.hashes()) < 7


def test_writer_killed_mid_write_leaves_no_partial_block(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", CRASH_WRITER, str(root)], stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"writing"
        time.sleep(0.05 + 0.05 * round_)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        tier = DiskTier(root, 1 << 30)
        assert tier.stats.corrupt == 0, "a final block name held a torn record"
        assert len(tier.hashes()) >= 3
        for block_hash in tier.hashes():
            found = tier.get(block_hash)
            assert found is not None and found[0] == bytes([block_hash % 251]) * 200_000
        assert tier.stats.hits == len(tier.hashes())
        assert not list(root.glob("??/*.tmp"))


def test_shared_dir_sees_blocks_other_writers_stored(tmp_path: Path) -> None:
    writer_a = SharedDirTier(tmp_path, 1 << 20, fsync=False)
    writer_b = SharedDirTier(tmp_path, 1 << 20, fsync=False)
    payload, meta = make_block(77, None, 1000)
    assert writer_a.put(77, payload, meta)
    assert writer_b.contains(77) and writer_b.get(77) == (payload, meta)
    assert writer_b.put(77, payload, meta)  # same hash from both: harmless
    writer_a.delete(77)
    assert writer_b.get(77) is None and writer_b.stats.misses == 1


def test_shared_dir_concurrent_writers_of_one_hash(tmp_path: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", SAME_HASH_WRITER, str(tmp_path)]) for _ in range(4)]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    reader = SharedDirTier(tmp_path, 1 << 30)
    assert reader.stats.corrupt == 0 and sorted(reader.hashes()) == list(range(1, 41))
    assert all(reader.get(h)[0] == bytes([h]) * 50_000 for h in range(1, 41))  # type: ignore[index]
