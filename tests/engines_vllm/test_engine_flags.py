"""Engine flags refused before anything starts: exit 2 and one line naming the flag (vLLM's own
options are checked by its venv's interpreter, so a bad one is named by vLLM's own parser)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines_vllm.conftest import VLLM_PYTHON

CHECK_S = 120


def tokenmill(python: str | Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "tokenmill.cli", *argv], capture_output=True, text=True,
                          timeout=CHECK_S)


@pytest.mark.parametrize("flags,named", [
    (["--engine", "sglang"], "--engine"),
    (["--engine-arg", "dtype=float32"], "--engine-arg"),
    (["--engine", "vllm", "--engine-arg", "no_such_option=1"], "--engine-arg no-such-option=1"),
    (["--engine", "vllm", "--engine-arg", "dtype"], "--engine-arg 'dtype'"),
    (["--engine", "vllm", "--", "--dtype", "float64"], "--dtype"),
    (["--engine", "vllm", "--block-size", "16"], "--block-size 16"),
    (["--engine", "vllm", "--engine-arg", "block_size=64"], "--block-size 32"),
    (["--engine", "vllm", "--engine-python", "/nonexistent/python"], "--engine-python /nonexistent/python"),
    (["--engine", "vllm", "--prefill", "1", "--decode", "1", "--kv-transfer-backends", "shm"],
     "--kv-transfer-backends shm"),
    (["--engine", "vllm", "--kv-host-gb", "1"], "--kv-host-gb"),
    (["--engine", "vllm", "--tp", "2"], "--tp"),
])
def test_serve_refuses_bad_engine_flags_naming_them(small_llama: Path, flags: list[str], named: str) -> None:
    result = tokenmill(sys.executable, "serve", "--model", str(small_llama), "--port", "0",
                       "--engine-python", str(VLLM_PYTHON), *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert named in lines[-1], lines
    if "--engine-python" not in named and named != "--engine":
        assert len(lines) == 1, lines  # one line, not vLLM's log nor a usage page


def test_a_missing_vllm_venv_says_how_to_install_it(small_llama: Path, tmp_path: Path) -> None:
    result = tokenmill(sys.executable, "serve", "--model", str(small_llama), "--engine", "vllm",
                       "--engine-python", "/nonexistent/python")
    assert result.returncode == 2
    assert "make install-vllm" in result.stderr
    # a worker started by an interpreter without vLLM (tokenmill's own venv) says the same
    result = tokenmill(sys.executable, "worker", "--model", str(small_llama), "--engine", "vllm",
                       "--discovery", f"file:{tmp_path / 'registry'}")
    assert result.returncode == 2 and "make install-vllm" in result.stderr, result.stderr


def test_the_worker_accepts_good_vllm_options(small_llama: Path) -> None:
    result = tokenmill(VLLM_PYTHON, "worker", "--model", str(small_llama), "--engine", "vllm", "--check-only",
                       "--engine-arg", "enforce_eager=true", "--engine-arg", "max_num_seqs=8", "--",
                       "--max-num-batched-tokens", "1024")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "accepted" in result.stdout
