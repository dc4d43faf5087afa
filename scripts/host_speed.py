"""How fast this host runs the suite's kind of work right now, in seconds of a fixed job.

    python scripts/host_speed.py        ->  host speed: 4.12 s for the fixed job (interpreter ...)

The suite's time is mostly processes starting (an interpreter importing torch) and small
single-threaded work; a shared 2-core host runs the same job 1.4-2.2x slower from one hour to the
next. `make test` prints this before pytest, so a suite time can be read against the host's speed
in the same run instead of against a figure from another hour.
"""
from __future__ import annotations

import subprocess
import sys
import time

STARTS = 2  # interpreters importing torch, one after another
MATMULS = 3000  # 256x256 fp32 products on one thread
PY_LOOP = 10_000_000  # iterations of plain Python


def _starts() -> float:
    began = time.perf_counter()
    for _ in range(STARTS):
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - began


def _matmuls() -> float:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    began = time.perf_counter()
    for _ in range(MATMULS):
        a = torch.tanh(a @ a)
    return time.perf_counter() - began


def _python() -> float:
    began = time.perf_counter()
    total = 0
    for i in range(PY_LOOP):
        total += i % 7
    return time.perf_counter() - began


def main() -> None:
    parts = {"interpreter starts": _starts(), "torch matmuls": _matmuls(), "python loop": _python()}
    detail = ", ".join(f"{name} {seconds:.2f}" for name, seconds in parts.items())
    print(f"host speed: {sum(parts.values()):.2f} s for the fixed job ({detail})")


if __name__ == "__main__":
    main()
