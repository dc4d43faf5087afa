"""Where the torch runner puts the model and the KV pool (`--device`).

    resolve_device("auto")   # "cuda" when torch sees a CUDA device, else "cpu"
    resolve_device("cuda")   # ValueError naming the flag when it sees none

On the CPU the native kernels (`engine/kernels/`) compute attention and the small-batch matmuls;
on a CUDA device PyTorch's own ops do (the kernels are CPU code), and steps are still prepared
and sampled on the host.
"""
from __future__ import annotations

DEVICES = ("cpu", "cuda", "auto")


def resolve_device(name: str) -> str:
    """`name`, one of DEVICES (the caller has checked it), as the device the runner uses."""
    if name == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if name == "cuda":
        raise ValueError("--device cuda: torch sees no CUDA device here (a CPU-only torch, or no GPU visible); "
                         "use --device cpu or auto")
    return "cpu"
