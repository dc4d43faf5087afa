"""Whether a process on this host is still alive: the one answer the engine's rank group and the
benchmarks' process handling both need (torch-free, importable from any package)."""
from __future__ import annotations

import os
from pathlib import Path


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent has not reaped still
    answers `kill(pid, 0)`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's: it exists
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc to ask: kill(pid, 0) said it exists
    return state != "Z"
