"""Python's shared-memory files in `/dev/shm` that a killed process group can no longer free:
`multiprocessing.shared_memory` segments (`psm_*`) and the named semaphores of multiprocessing's
locks and queues in a spawn context (`sem.mp-*`).

    segments = mapped_segments(group_members(pgid))   # before the SIGKILL: what the group maps
    os.killpg(pgid, signal.SIGKILL)
    remove_once_unmapped(segments, pgid)              # after: those no other process maps

vLLM's engine core and its workers talk through such segments (its message queues, 160 MiB and
more each); their finalizers unlink them (and multiprocessing's resource tracker its semaphores),
but a SIGKILL of the whole group skips both, and a segment left holds the memory written to it
until the next boot. Only files that no process outside the group maps are removed. A mapping is
matched by its inode: glibc maps a semaphore under the temporary name it created it with. Linux
only: elsewhere no process is found and nothing is removed.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PYTHON_PREFIXES = ("psm_", "sem.mp-")  # multiprocessing's generated names: segments, semaphores
UNMAP_WAIT_S = 2.0  # a SIGKILLed process's mappings go with it within milliseconds


def python_files() -> set[Path]:
    """Python's shared-memory files in /dev/shm now."""
    try:
        return {path for path in SHM_DIR.iterdir() if path.name.startswith(PYTHON_PREFIXES)}
    except OSError:
        return set()


def group_members(pgid: int) -> list[int]:
    """The processes whose process group is `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            after_name = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(after_name[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def mapped_segments(pids: Iterable[int]) -> set[Path]:
    """Python's shared-memory files these processes map now."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
            if len(fields) == 6 and fields[5].startswith(f"{SHM_DIR}/"):
                inodes.add(int(fields[4]))
    found = set()
    for path in python_files():
        try:
            if path.stat().st_ino in inodes:
                found.add(path)
        except FileNotFoundError:
            pass  # unlinked meanwhile
    return found


def mapped_anywhere() -> set[Path]:
    """Python's shared-memory files any process maps now."""
    return mapped_segments(int(p.name) for p in Path("/proc").glob("[0-9]*"))


def remove_once_unmapped(segments: set[Path], pgid: int) -> int:
    """Unlink those of `segments` that no process maps once group `pgid` is gone; how many."""
    deadline = time.monotonic() + UNMAP_WAIT_S
    while mapped_segments(group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    removed = 0
    for path in segments - mapped_anywhere():
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass  # its owner unlinked it after all
    return removed
