"""The decoder-only transformer shared by Llama, Qwen2, Mistral, Qwen3 and Qwen3-MoE.

Families differ only in options: q/k/v (and o) bias, per-head q/k RMSNorm (Qwen3),
and sparse MoE MLPs on some layers (Qwen3-MoE). Every forward takes a flattened
step (all sequences' new tokens concatenated) plus an `AttentionBatch`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.engine.attention import AttentionBatch, paged_attention, write_kv
from tokenmill.engine.kernels import layer_ops
from tokenmill.engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from tokenmill.engine.models.moe import SparseMoE
from tokenmill.engine.models.native_linear import NativeLinear
from tokenmill.textgen.model_config import ModelConfig


class Attention(nn.Module):
    # set on a rank of a tensor-parallel worker: sums the ranks' partial o_proj outputs
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = NativeLinear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = NativeLinear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_layer: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self._rotate_and_store(q, k, v, rope, kv_layer, batch.slot_mapping)
        out = self.o_proj(paged_attention(q, kv_layer, batch, self.scale))
        return out if self.reduce is None else self.reduce(out)

    @staticmethod
    def _rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                          kv_layer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on q and k, k and v stored at their slots: the rotated q."""
        cos, sin = rope
        if layer_ops.supports(q) and cos.dtype == kv_layer.dtype == q.dtype and kv_layer.is_contiguous():
            layer_ops.rope_store(q, k, v, cos, sin, kv_layer[0], kv_layer[1], slots)  # q and k in place
            return q
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(kv_layer, k, v, slots)
        return q


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, local_experts: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module
        if cfg.moe is not None and index in cfg.moe.sparse_layers:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, local_experts)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_layer: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_layer, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Parameter names mirror HF's (`model.layers.N...`, `lm_head`) except the fused
    `qkv_proj`, `gate_up_proj` and stacked expert weights, which the loader builds."""

    def __init__(self, cfg: ModelConfig, local_experts: tuple[int, int] | None = None) -> None:
        """`local_experts`: on an expert-parallel rank, the range of experts it holds. The rotary
        tables are computed, not loaded: the loader sets `rotary` once the skeleton holds real memory."""
        super().__init__()
        self.cfg = cfg
        # given its weight, the embedding skips its random init: on the meta device that init pulls in
        # torch._dynamo (seconds of a worker's start) and the checkpoint overwrites it anyway
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, local_experts) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = NativeLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        batch: AttentionBatch, logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (fp32) for the rows in `logits_rows` only; writes every token's K/V."""
        return self.logits(self.final_hidden(input_ids, positions, kv_cache, batch, logits_rows))

    @torch.inference_mode()
    def final_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        batch: AttentionBatch, logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """The last norm's output for the rows in `logits_rows` (what the LM head reads)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, kv_cache[i], batch)
        return self.norm(x.index_select(0, logits_rows))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
