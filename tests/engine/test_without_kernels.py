"""The parity, batching, preemption and chunked-prefill tests, run again with
TOKENMILL_DISABLE_KERNELS=1: the PyTorch path must stay correct on its own, not only as the
kernels' reference."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/engine/test_parity.py", "tests/engine/test_batching.py", "tests/engine/test_chunked_prefill.py"]


def test_the_pytorch_path_passes_parity_batching_and_preemption() -> None:
    env = {**os.environ, "TOKENMILL_DISABLE_KERNELS": "1"}
    probe = subprocess.run(
        [sys.executable, "-c", "from tokenmill.engine import kernels; "
         "from tokenmill.engine.kernels import grouped_experts, layer_ops, prefill_attention as p; import torch; "
         "print(kernels.available(), grouped_experts.available(torch.float32), p.supported(torch.float32, 64), "
         "layer_ops.supports(torch.zeros(1)))"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert probe.stdout.split() == ["False"] * 4
    run = subprocess.run([sys.executable, "-m", "pytest", *FILES, "-p", "no:cacheprovider", "-rA"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert len(re.findall(r"^PASSED ", run.stdout, re.M)) >= 8, run.stdout[-2000:]
    assert not re.search(r"^(SKIPPED|XFAIL|FAILED|ERROR) ", run.stdout, re.M), run.stdout[-2000:]
