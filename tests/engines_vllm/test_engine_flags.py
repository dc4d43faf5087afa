"""Engine flags refused before anything starts: exit 2 and one line naming the flag (vLLM's own
options are checked by its venv's interpreter, so a bad one is named by vLLM's own parser)."""
from __future__ import annotations

import json
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
    (["--engine", "vllm", "--prefill", "1", "--decode", "1", "--engine-arg",
      'kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}'],
     "--engine-arg kv_transfer_config"),
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


COMPOSED = """
import argparse, json, sys, tempfile
from pathlib import Path
from tokenmill.engines.vllm.config import EventEndpoints, engine_args_from
from tokenmill.worker.main import add_arguments
parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args(sys.argv[1:])
args.block_size = 32
config = engine_args_from(args, EventEndpoints.in_dir(Path(tempfile.mkdtemp()))).kv_transfer_config
print(json.dumps({"connector": config.kv_connector, "policy": config.kv_load_failure_policy,
                  "extra": config.kv_connector_extra_config}))
"""


def test_a_decode_worker_with_vllm_offload_runs_both_connectors(small_llama: Path, tmp_path: Path) -> None:
    """vLLM would replace the transfer connector with its offloading one: the worker composes both
    in vLLM's MultiConnector instead (its offload itself runs on CUDA hosts only; see docs/vllm.md)."""
    result = subprocess.run([str(VLLM_PYTHON), "-c", COMPOSED, "--model", str(small_llama), "--engine", "vllm",
                             "--role", "decode", "--discovery", f"file:{tmp_path / 'registry'}",
                             "--engine-arg", "kv_offloading_size=2"],
                            capture_output=True, text=True, timeout=CHECK_S)
    assert result.returncode == 0, result.stderr[-2000:]
    config = json.loads(result.stdout.strip().splitlines()[-1])
    assert config["connector"] == "MultiConnector" and config["policy"] == "recompute"
    first, second = config["extra"]["connectors"]
    assert first["kv_connector"] == "TokenmillConnector" and first["kv_connector_extra_config"]["worker_id"]
    assert second == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"cpu_bytes_to_use": 2 * (1 << 30)}}
