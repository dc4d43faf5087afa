"""Parameter and KV-cache accounting, split the way parallelism shards them."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.sim.models import ModelConfig


@dataclass(slots=True, frozen=True)
class ParamBreakdown:
    """Parameter counts (values, not bytes), grouped by how they are sharded."""

    attention_per_layer: int  # attention projections (+ norms) per layer
    dense_mlp_per_layer: int
    expert: int  # one routed expert
    shared_expert_total: int  # all shared experts of one MoE layer
    router_per_layer: int
    embedding: int  # input embedding + LM head (once if tied)

    def total(self, m: ModelConfig) -> int:
        moe = m.moe_layers * (m.experts * self.expert + self.shared_expert_total + self.router_per_layer)
        return m.layers * self.attention_per_layer + m.mlp_layers * self.dense_mlp_per_layer + moe + self.embedding

    def active(self, m: ModelConfig, input_embedding: bool = True) -> int:
        """Parameters touched per token: top-k routed + shared experts, LM head.

        `input_embedding=False` leaves out the input-embedding table (one row gathered per token, no
        multiply): DeepSeek's convention, see `active_params`.
        """
        moe = m.moe_layers * (m.top_k * self.expert + self.shared_expert_total + self.router_per_layer)
        lookup = 0 if input_embedding or m.tied_embeddings else m.vocab * m.hidden
        return m.layers * self.attention_per_layer + m.mlp_layers * self.dense_mlp_per_layer + moe + self.embedding - lookup


def attention_params(m: ModelConfig) -> int:
    d = m.hidden
    if m.is_mla:
        qk_dim = m.qk_nope_dim + m.qk_rope_dim
        q = d * m.q_lora_rank + m.q_lora_rank * m.heads * qk_dim if m.q_lora_rank else d * m.heads * qk_dim
        kv = d * (m.kv_lora_rank + m.qk_rope_dim) + m.kv_lora_rank * m.heads * (m.qk_nope_dim + m.v_head_dim)
        out = m.heads * m.v_head_dim * d
        norms = m.q_lora_rank + m.kv_lora_rank + 2 * d
        return q + kv + out + norms
    qkv = d * (m.heads + 2 * m.kv_heads) * m.head_dim
    return qkv + m.heads * m.head_dim * d + 2 * d


def param_breakdown(m: ModelConfig) -> ParamBreakdown:
    d = m.hidden
    embedding = m.vocab * d * (1 if m.tied_embeddings else 2)
    return ParamBreakdown(
        attention_per_layer=attention_params(m),
        dense_mlp_per_layer=3 * d * m.ffn,
        expert=3 * d * m.expert_ffn,
        shared_expert_total=3 * d * m.expert_ffn * m.shared_experts,
        router_per_layer=d * m.experts,
        embedding=embedding,
    )


def total_params(m: ModelConfig) -> int:
    return param_breakdown(m).total(m)


def active_params(m: ModelConfig, input_embedding: bool = True, mtp: bool = False) -> int:
    """Activated parameters per token. Vendors differ on the input-embedding table:

    - Qwen and Mistral count both embedding matrices (Qwen1.5-MoE-A2.7B's card: "2.7B activated,
      2.0B non-embedding"; Mixtral's 12.9 B needs both).
    - DeepSeek leaves the input lookup out and counts the LM head: of the three readings that one is
      the closest to each published figure of the family (V2-Lite 2.45 B vs "2.4B", V2 20.85 B vs
      "21B", V3 36.63 B vs "37B"; counting both gives 2.66 / 21.38 / 37.55, neither 2.24 / 20.33 / 35.70).

    `mtp=True` adds the checkpoint's multi-token-prediction modules as they run per token (see
    `mtp_module_active_params`): DeepSeek-V3's "37B activated" is stated for its configuration with
    MTP depth 1 (V3 paper, hyper-parameters: "... D is set to 1 ... Under this configuration,
    DeepSeek-V3 comprises 671B total parameters, of which 37B are activated for each token"), while
    its 671 B total is the main model alone (model card: 685 B = 671 B main + 14 B MTP).
    """
    extra = m.mtp_modules * mtp_module_active_params(m) if mtp else 0
    return param_breakdown(m).active(m, input_embedding) + extra


def mtp_module_active_params(m: ModelConfig) -> int:
    """One DeepSeek MTP module per token: the projection of [embedding; hidden] (2d x d), its two input
    norms and output norm, and one transformer block (MoE active part when the model is MoE); the
    embedding table and LM head are shared with the main model, so they are not counted again."""
    p = param_breakdown(m)
    d = m.hidden
    ffn = m.top_k * p.expert + p.shared_expert_total + p.router_per_layer if m.is_moe else p.dense_mlp_per_layer
    return 2 * d * d + 3 * d + p.attention_per_layer + ffn


def kv_values_per_token_per_layer(m: ModelConfig) -> int:
    """Cached values per token per layer: MLA keeps the latent + rope key, GQA keeps K and V."""
    if m.is_mla:
        return m.kv_lora_rank + m.qk_rope_dim
    return 2 * m.kv_heads * m.head_dim


def kv_bytes_per_token(m: ModelConfig, kv_bytes_per_value: float = 2.0, context: int | None = None) -> float:
    """KV bytes per token over all layers; sliding-window layers stop growing past their window."""
    per_layer = kv_values_per_token_per_layer(m) * kv_bytes_per_value
    if m.sliding_window and context is not None and context > m.sliding_window:
        sliding_share = m.sliding_fraction * m.sliding_window / context
        return per_layer * m.layers * (1 - m.sliding_fraction + sliding_share)
    return per_layer * m.layers
