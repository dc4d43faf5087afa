"""Python shared-memory segments (`/dev/shm/psm_*`) that a killed process group can no longer free.

    segments = mapped_segments(group_members(pgid))   # before the SIGKILL: what the group maps
    os.killpg(pgid, signal.SIGKILL)
    remove_once_unmapped(segments, pgid)              # after: those no other process maps

vLLM's engine core and its workers talk through such segments (its message queues, 160 MiB and
more each); their finalizers unlink them, but a SIGKILL skips finalizers, and a segment left holds
the memory written to it until the next boot. Only segments that no process outside the group maps
are removed. Linux only: elsewhere no process is found and nothing is removed.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PYTHON_SEGMENT = "psm_"  # the prefix of multiprocessing.shared_memory's generated names
UNMAP_WAIT_S = 2.0  # a SIGKILLed process's mappings go with it within milliseconds


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
    """The Python shared-memory segments these processes map now."""
    found: set[Path] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
            if len(fields) == 6 and fields[5].startswith(f"{SHM_DIR}/{PYTHON_SEGMENT}"):
                found.add(Path(fields[5].removesuffix(" (deleted)")))
    return found


def mapped_anywhere() -> set[Path]:
    """The Python shared-memory segments any process maps now."""
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
