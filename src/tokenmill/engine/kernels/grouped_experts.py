"""Small-M matmuls through `grouped_experts.c`: all active experts of a MoE layer in one call,
and dense linears at decode batch sizes, each weight read once from memory per step.

Weights are packed once (`pack_panels`) into 16-row panels, `[ceil(O/16), K, 16]` per matrix,
kept in their dtype (bf16 or fp32); rows and sums are fp32. Callers keep their PyTorch path
for large M (prefill), where GEMM libraries are compute-bound and faster, and for whatever
`available()` refuses. Both run on `torch.get_num_threads()` threads when their weights are
large enough to share out.
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from tokenmill.engine.huge_pages import empty_huge
from tokenmill.engine.kernels import load_library
from tokenmill.engine.kernels.packed_linear import bf16_packing_available

PANEL = 16
DTYPES = (torch.bfloat16, torch.float32)
# Up to this many rows a step is memory-bound and these kernels win everywhere. Above it GEMM
# libraries are compute-efficient and multi-threaded, so they take over, except for bf16 on
# CPUs without native bf16 matmuls, where the library is the slower one at every size
# (measured on an AVX2 EPYC, one thread: 3-6x at 16-512 rows; fp32 about even at 512).
NATIVE_MAX_ROWS = 64


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_library("grouped_experts.c")
    if lib is None:
        return None
    for suffix in ("bf16", "f32"):
        linear = getattr(lib, f"tm_linear_{suffix}")
        linear.argtypes, linear.restype = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4, ctypes.c_int
        moe = getattr(lib, f"tm_moe_{suffix}")
        moe.argtypes, moe.restype = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6, ctypes.c_int
    return lib


def available(dtype: torch.dtype) -> bool:
    return dtype in DTYPES and _library() is not None


def use_native(x: torch.Tensor, weight_dtype: torch.dtype, rows: int, every_size: bool = False) -> bool:
    """Whether a CPU inference call of `rows` rows should take these kernels (see NATIVE_MAX_ROWS);
    `every_size`: whenever they can, for their results that do not depend on the rows."""
    if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != weight_dtype or not available(x.dtype):
        return False
    return every_size or rows <= NATIVE_MAX_ROWS or (x.dtype == torch.bfloat16 and not bf16_packing_available())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[..., O, K] -> [..., ceil(O/16), K, 16]: panel j holds rows 16j..16j+15 interleaved by
    column, zero past row O (a copy; the source is untouched)."""
    *lead, out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = weight.new_zeros(*lead, panels * PANEL, in_features)
    padded[..., :out_features, :] = weight
    # on huge pages where the host gives them: every decode step streams the panels
    packed = empty_huge(*lead, panels, in_features, PANEL, dtype=weight.dtype, device=weight.device)
    return packed.copy_(padded.view(*lead, panels, PANEL, in_features).transpose(-1, -2))


def _fn(kind: str, dtype: torch.dtype) -> ctypes._CFuncPtr:
    lib = _library()
    if lib is None or dtype not in DTYPES:
        raise RuntimeError(f"native {kind} kernel unavailable for {dtype}")
    return getattr(lib, f"tm_{kind}_{'bf16' if dtype == torch.bfloat16 else 'f32'}")


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] (any float dtype) @ W^T with W packed by `pack_panels` -> [M, out_features] fp32."""
    xf = x.float().contiguous()
    m, k = xf.shape
    if packed.dim() != 3 or packed.shape[1] != k or packed.shape[0] * PANEL < out_features:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)} -> {out_features}")
    y = torch.empty(m, out_features, dtype=torch.float32)
    if _fn("linear", packed.dtype)(xf.data_ptr(), packed.data_ptr(), y.data_ptr(), m, k, out_features,
                                   torch.get_num_threads()):
        raise MemoryError("native linear kernel could not allocate its scratch buffers")
    return y


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, packed_gate_up: torch.Tensor,
                packed_down: torch.Tensor, intermediate: int) -> torch.Tensor:
    """sum over k of weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = expert_ids[t, k];
    an id of -1 is skipped (another rank's expert).

    x [T, H]; expert_ids [T, top_k] int64; weights [T, top_k]; packed_gate_up [E, ceil(2I/16), H, 16]
    (gate rows first, then up); packed_down [E, ceil(H/16), I, 16]. -> [T, H] fp32."""
    xf = x.float().contiguous()
    tokens, hidden = xf.shape
    num_experts = packed_gate_up.shape[0]
    if packed_gate_up.shape[2] != hidden or packed_down.shape[2] != intermediate \
            or packed_down.shape[0] != num_experts or expert_ids.shape != weights.shape:
        raise ValueError("moe_experts: packed weights, ids and weights do not fit together")
    ids = expert_ids.to(torch.int64).contiguous()
    w = weights.float().contiguous()
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    rc = _fn("moe", packed_gate_up.dtype)(xf.data_ptr(), ids.data_ptr(), w.data_ptr(), packed_gate_up.data_ptr(),
                                          packed_down.data_ptr(), out.data_ptr(), tokens, ids.shape[1],
                                          num_experts, hidden, intermediate, torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"expert ids must lie in [0, {num_experts}), or be -1 (skipped)")
    if rc:
        raise MemoryError("native MoE kernel could not allocate its scratch buffers")
    return out
