"""Where a run's Unix sockets go.

A Unix socket's address must fit `sockaddr_un.sun_path`: 108 bytes on Linux, its closing NUL
included. A run directory deep in a tree (a test's temporary directory, a long `--run-dir`) leaves
too little room, and binding fails. Such a run keeps its other files where it was told and puts
its sockets in a short private directory instead.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

SUN_PATH_MAX = 107  # bytes before the closing NUL
NAME_ROOM = 48  # the longest socket name a run gives ("<worker name>-events.sock"), with room to spare


def socket_dir(run_dir: Path) -> Path:
    """`run_dir` when a name of NAME_ROOM bytes fits under it; else a new private directory under the
    system's temporary directory, which the caller removes when the run ends."""
    if len(os.fsencode(run_dir)) + 1 + NAME_ROOM <= SUN_PATH_MAX:
        return run_dir
    return Path(tempfile.mkdtemp(prefix="tm-sock-"))
