"""`--device`: the flag's checks on any host, and `scripts/gpu-check`'s steps run on the CPU (on a
GPU host the script itself is the check of the CUDA path: it is not run by the suite)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.engine import config
from tokenmill.engine.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]


def _serve(model: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(model), "--port", "0",
                           *flags], capture_output=True, text=True, timeout=60)


def test_cuda_is_refused_where_torch_sees_no_gpu_and_taken_where_it_does(tiny_dense: Path) -> None:
    if torch.cuda.is_available():
        assert EngineConfig(model=str(tiny_dense), device="cuda").device == "cuda"
        assert EngineConfig(model=str(tiny_dense), device="auto").device == "cuda"
        return
    done = _serve(tiny_dense, "--device", "cuda")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "--device cuda: torch sees no CUDA device" in lines[0]
    assert EngineConfig(model=str(tiny_dense), device="auto").device == "cpu"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"runner": "mock"}, "--device cuda: the mock runner computes nothing"),
    ({"tp": 2}, "--device cuda: --tp, --ep and --attention-dp run on the CPU only"),
    ({"kv_host_gb": 1.0}, "--device cuda: the KV tiers copy from a host-memory pool"),
    ({"deterministic": True}, "--device cuda: --deterministic needs the native CPU kernels"),
])
def test_what_runs_on_the_cpu_only_is_refused_naming_the_flag(tiny_dense: Path, overrides: dict, message: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "resolve_device", lambda device: "cuda")  # as on a host with a GPU
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(tiny_dense), device="cuda", **overrides)


def test_gpu_check_runs_its_steps_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu-check"), "--device", "cpu", "--preset",
                           "tiny-llama", "--out", str(out), "--requests", "4", "--prompt-tokens", "32",
                           "--output-tokens", "16", "--parity-prompts", "2", "--parity-tokens", "12"],
                          capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    assert done.returncode == 0 and report["ran"], report.get("error") or done.stderr[-2000:]
    parity, throughput = report["parity"], report["throughput"]
    assert parity["identical"] and parity["tokens_agreeing_before_first_difference"] == [12, 12]
    assert parity["max_abs_logit_diff_at_prompt_end"] < 1e-3
    assert throughput["output_tokens"] == 4 * 16 and throughput["tokenmill_tok_s"] > 0
    assert throughput["memory_floor_ms"] > 0 and throughput["decode_step_ms"] > 0
    assert throughput["tokenmill_eager_tok_s"] > 0 and throughput["graphed_steps"] == 0  # graphs: CUDA only
