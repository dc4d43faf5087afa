"""vLLM workers under a real `tokenmill serve`, and vLLM alone as the reference.

vLLM runs from its own venv (`make install-vllm`, which `make test` runs): these tests fail, never
skip, where it is missing. The model is `small-llama` (random weights, head size 64: the smallest
shape vLLM's CPU attention runs), in blocks of 32 tokens (what that attention needs).
"""
from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.serving.conftest import Server, start_server, stop_server
from tokenmill.engine.make_model import write_model
from tokenmill.engines.options import VLLM_VENV
from tokenmill.runtime.shared_segments import mapped_anywhere, python_files

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / VLLM_VENV / "bin" / "python"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
KV_BLOCKS = 48  # per worker: five 600-token prompts overflow it (the removal test)
# float32 as vLLM alone runs: `--dtype auto` is the checkpoint's bf16 on a host with AMX
ENGINE_FLAGS = ("--engine", "vllm", "--engine-python", str(VLLM_PYTHON), "--engine-arg", "enforce_eager=true",
                "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32")
VLLM_START_S = 300  # a cold vLLM start on 2 busy cores (its first one also fills caches)


@dataclass(slots=True)
class Deployment:
    server: Server
    model: Path


@pytest.fixture(scope="session")
def small_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model("small-llama", tmp_path_factory.mktemp("models") / "small-llama", seed=0)


@pytest.fixture(scope="module")
def vllm_deployment(small_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Two vLLM workers behind one frontend, KV-routed."""
    assert VLLM_PYTHON.is_file(), f"no {VLLM_PYTHON}: run `make install-vllm`"
    run_dir = tmp_path_factory.mktemp("vllm-run")
    before = python_files()
    server = start_serving(small_llama, run_dir, "--router", "kv", "--kv-cache-blocks", str(KV_BLOCKS), workers=2)
    try:
        yield Deployment(server, small_llama)
    finally:
        stop_server(server)
    assert not left_behind(before), "vLLM's shared-memory queues outlived the deployment"


def left_behind(before: set[Path]) -> set[Path]:
    """Shared-memory segments made since `before` that no process maps any more: leaked (vLLM's
    processes unlink theirs as they stop; a SIGKILL skips that, and serve must clean up after it)."""
    return python_files() - before - mapped_anywhere()


def start_serving(model: Path, run_dir: Path, *flags: str, workers: int) -> Server:
    server = start_server(model, run_dir, *ENGINE_FLAGS, *flags, workers=workers, start_timeout_s=VLLM_START_S)
    return server


class VLLMAlone:
    """vLLM's own greedy token ids for `prompts` (ignore_eos), from a process of vLLM's venv that
    starts at once, so that it runs while a deployment starts; `outputs()` waits for them."""

    def __init__(self, model: Path, prompts: list[list[int]], max_tokens: int, out_dir: Path) -> None:
        job = {"model": str(model), "prompts": prompts, "max_tokens": max_tokens, "block_size": BLOCK_SIZE,
               "max_model_len": MAX_MODEL_LEN}
        self._out, self._log = out_dir / "outputs.json", out_dir / "vllm-alone.log"
        with self._log.open("w") as log:
            self._process = subprocess.Popen([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_alone.py")),
                                              str(self._out)], stdin=subprocess.PIPE, stdout=log,
                                             stderr=subprocess.STDOUT, text=True)
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(job))
        self._process.stdin.close()

    def outputs(self) -> list[list[int]]:
        returncode = self._process.wait(timeout=VLLM_START_S)
        assert returncode == 0, self._log.read_text(encoding="utf-8")[-3000:]
        return json.loads(self._out.read_text(encoding="utf-8"))["outputs"]

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
