"""Which processes a benchmark left running: live pids (other than this one) whose argv matches."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def live_pids(matches: Callable[[list[bytes]], bool]) -> set[int]:
    """Pids of live processes whose argv (split on NUL) `matches`."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue  # exited meanwhile
        if argv and int(entry.name) != os.getpid() and matches(argv.split(b"\0")):
            pids.add(int(entry.name))
    return pids
