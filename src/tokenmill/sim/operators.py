"""Per-layer operator times on one GPU: max(FLOPs / (peak * eff), bytes / (bw * eff)) + fixed latency.

Every function takes arrays that broadcast together (one element per design point) and returns the
seconds one GPU spends on that operator for one layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.sim.hardware import GpuSpec
from tokenmill.sim.models import ModelConfig
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.precision import FORMATS, PrecisionPlan
from tokenmill.sim.tuning import Tuning

# Kernel launches per block (norms, rope, residual adds, activation, routing and top-k included).
KERNELS_ATTENTION_GQA = 6
# MLA decode, absorbed form: input norm, fused q_a/kv_a GEMM, q_a norm, kv_a norm, q_b GEMM, W_UK BMM,
# RoPE + latent-cache append, MLA attention, split-KV combine, W_UV BMM, o_proj GEMM.
KERNELS_ATTENTION_MLA = 11
KERNELS_DENSE_MLP = 4
# On the critical path: post-attention norm, router GEMM, top-k routing, permute/expand (+ quantize),
# FC1 grouped GEMM (activation fused), FC2 grouped GEMM, finalize/unpermute, shared-expert join; the
# shared expert's own GEMMs run on a second stream (TensorRT-LLM tech blog 1, multi-stream).
KERNELS_MOE = 8


@dataclass(slots=True, frozen=True)
class StepShape:
    """Work in one engine step, per attention-DP rank (arrays broadcast together)."""

    prefill_tokens: np.ndarray  # new prompt tokens computed this step
    prefill_ctx: np.ndarray  # mean number of keys each prefill token attends to
    decode_seqs: np.ndarray  # sequences decoding this step
    decode_ctx: np.ndarray  # mean KV length of the decoding sequences
    tokens_per_seq: float = 1.0  # decode tokens verified per sequence per step (1 + MTP drafts)
    output_rows: np.ndarray | float = 0.0  # extra LM-head rows (prefills finishing this step)

    @property
    def tokens(self) -> np.ndarray:
        return self.prefill_tokens + self.decode_seqs * self.tokens_per_seq


@dataclass(slots=True, frozen=True)
class OpContext:
    model: ModelConfig
    gpu: GpuSpec
    plan: PrecisionPlan
    tuning: Tuning

    def for_prefill(self) -> "OpContext":
        """The same context with the prefill kernels' efficiency (`tuning.prefill_compute_scale`)."""
        return OpContext(self.model, self.gpu, self.plan, self.tuning.replace(compute_scale=self.tuning.prefill_compute_scale))

    def with_tuning(self, **changes: float | bool) -> "OpContext":
        return OpContext(self.model, self.gpu, self.plan, self.tuning.replace(**changes))

    def kernel_latency(self, kernels: int) -> float:
        return kernels * self.gpu.kernel_latency_s * self.tuning.latency_scale

    def gemm(self, flops: np.ndarray, weight_bytes: np.ndarray, rows: np.ndarray, act_bytes: np.ndarray | float = 0.0,
             scale: float = 1.0, compute: str | None = None) -> np.ndarray:
        """A weight GEMM: compute at the weight format's rate, reads weights + activations.

        `scale` multiplies the efficiency for kernels that fall short of a dense GEMM's curve;
        `compute` overrides the weights' compute precision (attention kept out of 4-bit).
        """
        peak = self.gpu.peak_flops(compute or self.plan.weights.compute)
        eff = self.gpu.gemm_efficiency(rows) * self.tuning.compute_scale * scale
        bw = self.gpu.hbm_bw * self.gpu.mem_eff * self.tuning.mem_scale
        return np.maximum(flops / (peak * np.minimum(eff, 1.0)), (weight_bytes + act_bytes) / bw)

    def attention(self, flops: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        peak = self.gpu.peak_flops("bf16")
        eff = min(self.gpu.attn_eff * self.tuning.compute_scale, 1.0)
        bw = self.gpu.hbm_bw * self.gpu.mem_eff * self.tuning.mem_scale
        return np.maximum(flops / (peak * eff), nbytes / bw)


def _windowed_ctx(m: ModelConfig, ctx: np.ndarray) -> np.ndarray:
    """Mean keys per layer when some layers use a sliding window."""
    if not m.sliding_window:
        return ctx
    return (1 - m.sliding_fraction) * ctx + m.sliding_fraction * np.minimum(ctx, m.sliding_window)


def attention_gqa(c: OpContext, par: Parallel, s: StepShape) -> np.ndarray:
    m, tp, fmt = c.model, par.tp, c.plan.attention_weights
    wb, cp = fmt.bytes_per_value, fmt.compute
    t = s.tokens
    qkv_cols = (m.heads + 2 * m.kv_heads) * m.head_dim
    proj = c.gemm(2 * t * m.hidden * qkv_cols / tp, m.hidden * qkv_cols * wb / tp, t, t * m.hidden * 2, compute=cp)
    proj += c.gemm(2 * t * m.heads * m.head_dim * m.hidden / tp, m.heads * m.head_dim * m.hidden * wb / tp, t, compute=cp)
    heads = m.heads / tp
    kv_heads_gpu = np.maximum(m.kv_heads / tp, 1.0)  # KV heads replicate when tp > kv_heads
    pre = c.attention(4 * s.prefill_tokens * _windowed_ctx(m, s.prefill_ctx) * heads * m.head_dim,
                      s.prefill_tokens * qkv_cols * 2 / tp)
    dctx = _windowed_ctx(m, s.decode_ctx)
    dec = c.attention(4 * s.decode_seqs * s.tokens_per_seq * dctx * heads * m.head_dim,
                      s.decode_seqs * dctx * 2 * kv_heads_gpu * m.head_dim * c.plan.kv.bytes_per_value)
    return proj + pre + dec + c.kernel_latency(KERNELS_ATTENTION_GQA)


def attention_mla(c: OpContext, par: Parallel, s: StepShape) -> np.ndarray:
    """DeepSeek MLA: naive form for prefill, weight-absorbed form for decode; latent KV replicated over TP."""
    m, tp, fmt = c.model, par.tp, c.plan.attention_weights
    wb, cp = fmt.bytes_per_value, fmt.compute
    t, d, heads = s.tokens, m.hidden, m.heads / tp
    qk, latent = m.qk_nope_dim + m.qk_rope_dim, m.kv_lora_rank + m.qk_rope_dim
    down = d * (m.q_lora_rank + latent)  # fused q_a + kv_a, replicated on every TP rank
    proj = c.gemm(2 * t * down, down * wb, t, t * d * 2, compute=cp)
    proj += c.gemm(2 * t * m.q_lora_rank * heads * qk, m.q_lora_rank * m.heads * qk * wb / tp, t, compute=cp)
    kv_b = m.kv_lora_rank * m.heads * (m.qk_nope_dim + m.v_head_dim)
    proj += c.gemm(2 * t * kv_b / tp, kv_b * wb / tp, t, compute=cp)  # up-projection (prefill) or absorbed W_UK/W_UV (decode)
    proj += c.gemm(2 * t * m.heads * m.v_head_dim * d / tp, m.heads * m.v_head_dim * d * wb / tp, t, compute=cp)
    pre = c.attention(2 * s.prefill_tokens * s.prefill_ctx * heads * (qk + m.v_head_dim),
                      s.prefill_tokens * heads * (qk + m.v_head_dim) * 2)
    dec = c.attention(2 * s.decode_seqs * s.tokens_per_seq * s.decode_ctx * heads * (latent + m.kv_lora_rank),
                      s.decode_seqs * s.decode_ctx * latent * c.plan.kv.bytes_per_value)
    return proj + pre + dec + c.kernel_latency(KERNELS_ATTENTION_MLA)


def attention_block(c: OpContext, par: Parallel, s: StepShape) -> np.ndarray:
    return attention_mla(c, par, s) if c.model.is_mla else attention_gqa(c, par, s)


def dense_mlp(c: OpContext, par: Parallel, s: StepShape) -> np.ndarray:
    m, t = c.model, s.tokens
    w = 3 * m.hidden * m.ffn
    return c.gemm(2 * t * w / par.tp, w * c.plan.weights.bytes_per_value / par.tp, t) + c.kernel_latency(KERNELS_DENSE_MLP)


def moe_block(c: OpContext, par: Parallel, s: StepShape) -> np.ndarray:
    """Routed experts over the stage's GPUs, plus shared experts split over attention TP."""
    m, wb = c.model, c.plan.weights.bytes_per_value
    group_tokens = s.tokens * par.dp  # distinct tokens in the EP group
    imbalance = np.where(par.ep > 1, c.tuning.moe_imbalance, 1.0)
    expert_w = 3 * m.hidden * m.expert_ffn
    routed_flops = 2 * expert_w * group_tokens * m.top_k * imbalance / par.stage_gpus
    touched = (m.experts / par.ep) * (1.0 - (1.0 - m.top_k / m.experts) ** group_tokens)
    rows = np.maximum(group_tokens * m.top_k / m.experts, 1.0)
    # Routed experts run as a grouped GEMM behind token permutation (scatter/gather of the rows), which
    # reaches a smaller share of peak than one dense GEMM of the same rows: `tuning.moe_compute_scale`.
    t = c.gemm(routed_flops, touched * expert_w * wb / par.moe_tp, rows, scale=c.tuning.moe_compute_scale)
    if m.shared_experts:
        shared_w = expert_w * m.shared_experts
        t = t + c.gemm(2 * s.tokens * shared_w / par.tp, shared_w * wb / par.tp, s.tokens)
    router = c.gemm(2 * s.tokens * m.hidden * m.experts, m.hidden * m.experts * 2.0, s.tokens)
    return t + router + c.kernel_latency(KERNELS_MOE)


def lm_head(c: OpContext, par: Parallel, s: StepShape) -> np.ndarray:
    """Vocabulary projection for rows that need logits (kept in BF16 by quantised checkpoints)."""
    m = c.model
    rows = s.decode_seqs * s.tokens_per_seq + s.output_rows
    w = m.hidden * m.vocab / par.tp
    peak = c.gpu.peak_flops("bf16") * c.gpu.gemm_efficiency(rows) * c.tuning.compute_scale
    bw = c.gpu.hbm_bw * c.gpu.mem_eff * c.tuning.mem_scale
    return np.maximum(2 * rows * w / peak, w * FORMATS["bf16"].bytes_per_value / bw) + c.kernel_latency(2)
