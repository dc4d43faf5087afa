"""A process's scratch directory, findable by its pid once the process is gone.

    path = scratch_dir("vllm-worker-0")   # <tmp>/tokenmill-<pid>-vllm-worker-0-XXXXXXXX, made now
    ...                                   # the process removes it when it stops
    remove_scratch_of(pid)                # its supervisor, after a SIGKILL skipped that: how many

The pid is followed by a dash, so `tokenmill-12-*` never matches a directory of pid 123.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "tokenmill-"


def scratch_dir(label: str) -> Path:
    """A new private directory under the system's temporary directory, named for this process."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{label}-"))


def remove_scratch_of(pid: int) -> int:
    """Remove the scratch directories process `pid` made and left; returns how many."""
    found = list(Path(tempfile.gettempdir()).glob(f"{PREFIX}{pid}-*"))
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return len(found)
