"""RMSNorm and rotary-embedding-plus-KV-store through `layer_ops.c`: one call each where PyTorch
takes a chain of small operators (what a decode step of a small model spends a tenth of its
time on). Same results as the PyTorch expressions in `models/layers.py` and `attention.py`.

`supports(x)` says where they run (CPU inference on bf16 or fp32 with the kernels built);
elsewhere callers keep PyTorch.
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from tokenmill.engine.kernels import MAX_HEAD_DIM, load_library

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def _functions() -> dict[torch.dtype, tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]] | None:
    """(RMSNorm, rope-and-store) per dtype; None where the kernels cannot be built."""
    lib = load_library("layer_ops.c")
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    functions = {}
    for dtype, suffix in _SUFFIX.items():
        norm = getattr(lib, f"tm_rms_norm_{suffix}")
        norm.argtypes, norm.restype = [p, p, p, i64, i32, ctypes.c_float, i32], i32
        rope = getattr(lib, f"tm_rope_store_{suffix}")
        rope.argtypes, rope.restype = [p, i64, p, i64, p, i64, p, p, p, p, p, i64, i64, i32, i32, i32, i32], i32
        functions[dtype] = (norm, rope)
    return functions


def supports(x: torch.Tensor) -> bool:
    return x.dtype in _SUFFIX and x.device.type == "cpu" and not torch.is_grad_enabled() and _functions() is not None


def _for(dtype: torch.dtype) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    functions = _functions()
    if functions is None or dtype not in functions:
        raise RuntimeError(f"no layer-op kernels for {dtype} here")
    return functions[dtype]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) over x's last dim, normalised in fp32 and
    rounded to x's dtype before the scale (as HF's Llama does)."""
    dim = x.shape[-1]
    if weight.dtype != x.dtype or weight.shape != (dim,):
        raise ValueError(f"RMSNorm weight {weight.dtype} {tuple(weight.shape)} does not fit x {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty_like(x)
    _for(x.dtype)[0](x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                           torch.get_num_threads())
    return out


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Rotates q [T, H, D] and k [T, KVH, D] in place (x*cos + rotate_half(x)*sin, cos/sin [T, D]),
    then stores k and v [T, KVH, D] at `slots` of the caches [blocks, block_size, KVH, D]. Each
    tensor's heads must be contiguous rows (a split of one projection's output is fine)."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    dtype = q.dtype
    if (dim % 2 or dim > MAX_HEAD_DIM or k.shape != v.shape or k.shape[0] != tokens or cos.shape != (tokens, dim)
            or sin.shape != cos.shape or k_cache.shape[-2:] != (kv_heads, dim) or v_cache.shape != k_cache.shape
            or (q.stride()[1:], k.stride()[1:], v.stride()[1:]) != ((dim, 1),) * 3
            or not (cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())
            or not k.dtype == v.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype == dtype):
        raise ValueError("rope_store: q, k, v, cos/sin and the caches do not fit together")
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        slots = slots.to(torch.int64).contiguous()
    rows = k_cache.numel() // (kv_heads * dim)
    if _for(dtype)[1](q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                            rows, tokens, heads, kv_heads, dim, torch.get_num_threads()):
        raise IndexError(f"rope_store: a slot outside the cache's {rows} rows")
