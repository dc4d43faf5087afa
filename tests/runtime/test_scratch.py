"""A process's scratch directory is found by its pid, and only by its own."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tokenmill.runtime.scratch import remove_scratch_of, scratch_dir


def test_a_dead_process_scratch_is_removed_by_pid_and_no_other(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = scratch_dir("vllm-worker-0")
    (mine / "engine.sock").write_text("")
    assert mine.parent == tmp_path and mine.name.startswith(f"tokenmill-{os.getpid()}-vllm-worker-0-")
    longer_pid = tmp_path / f"tokenmill-{os.getpid()}0-vllm-worker-1-abc"  # another pid that starts alike
    longer_pid.mkdir()
    run_dir = tmp_path / "tokenmill-abcd1234"  # a serve run directory: no pid in it
    run_dir.mkdir()
    assert remove_scratch_of(os.getpid()) == 1
    assert not mine.exists() and longer_pid.is_dir() and run_dir.is_dir()
    assert remove_scratch_of(os.getpid()) == 0
