"""Building blocks shared by every decoder family: RMSNorm, rotary embedding, MLPs."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.engine.kernels.packed_linear import PackedLinear, bf16_packing_available, pack_experts
from tokenmill.textgen.model_config import ModelConfig, MoEConfig


class RMSNorm(nn.Module):
    """Normalises in fp32 and scales in the activation dtype, as HF's Llama/Qwen do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context length, built once."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = _inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def _inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type", "default"))
    if kind == "linear":
        return inv / float(cfg.rope_scaling["factor"])
    if kind == "llama3":
        return _llama3_scale(inv, cfg.rope_scaling, cfg.max_position_embeddings)
    return inv


def _llama3_scale(inv: torch.Tensor, p: dict, max_pos: int) -> torch.Tensor:
    """Llama 3.1's frequency-dependent stretch of long wavelengths."""
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p.get("original_max_position_embeddings", max_pos))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Top-k softmax router; each expert runs only on the tokens routed to it.

    Tokens are sorted by expert so every expert does one dense GEMM on a
    contiguous slice, then results are scattered back weighted by the router.
    """

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.num_experts = moe.num_experts
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, hidden))
        self.w_down = nn.Parameter(torch.empty(moe.num_experts, hidden, moe.intermediate_size))
        self._packed: tuple[list[PackedLinear], list[PackedLinear]] | None = None

    def prepack(self) -> None:
        """Pack the expert weights now, once they are loaded: packed lazily, the first forward
        would carry the cost (~80 ms a layer on small-moe) into some request's latency."""
        self._packed = self._pack()

    def _pack(self) -> tuple[list[PackedLinear], list[PackedLinear]] | None:
        gate_up, down = pack_experts(self.w_gate_up), pack_experts(self.w_down)
        return (gate_up, down) if gate_up and down else None

    def _packed_experts(self, x: torch.Tensor) -> tuple[list[PackedLinear], list[PackedLinear]] | None:
        """Expert weights packed once for oneDNN (bf16 CPU inference only): with few rows per
        expert, re-packing them on every call is most of the MoE's time (kernels/packed_linear.py).
        Repacked when the weights change; None where packing does not apply."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or torch.is_grad_enabled() \
                or not bf16_packing_available():
            return None
        packed = self._packed
        if packed is None or packed[0][0].stale(self.w_gate_up[0]) or packed[1][0].stale(self.w_down[0]):
            packed = self._packed = self._pack()
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        xs = x.index_select(0, token_of)
        outs = torch.empty_like(xs)
        packed = self._packed_experts(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = xs[start:start + n]
                if packed is None:
                    gate, up = F.linear(rows, self.w_gate_up[e]).chunk(2, dim=-1)
                    outs[start:start + n] = F.linear(F.silu(gate) * up, self.w_down[e])
                else:
                    gate, up = packed[0][e](rows).chunk(2, dim=-1)
                    outs[start:start + n] = packed[1][e](F.silu(gate) * up)
                start += n
        outs = outs * weights[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token_of, outs)


def prepack_experts(model: nn.Module) -> None:
    """Pack every MoE layer's expert weights (a no-op where packing does not apply); call after
    the weights are loaded."""
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.prepack()
