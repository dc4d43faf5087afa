"""Per-GPU memory: sharded weights + KV cache + reserve must fit, which bounds the batch."""
from __future__ import annotations

import numpy as np

from tokenmill.sim.accounting import kv_values_per_token_per_layer, param_breakdown
from tokenmill.sim.hardware import GpuSpec
from tokenmill.sim.models import ModelConfig
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.precision import PrecisionPlan

GB = 1e9
# Activations, CUDA graphs, workspace and allocator slack: engines keep ~8-10% of HBM free
# (vLLM gpu_memory_utilization 0.9, TensorRT-LLM free_gpu_memory_fraction 0.9) plus fixed buffers.
RESERVE_FRACTION = 0.08
RESERVE_BYTES = 2 * GB


def weight_bytes_per_gpu(m: ModelConfig, par: Parallel, plan: PrecisionPlan) -> np.ndarray:
    """Weights one GPU holds; MLA down-projections are replicated, embeddings are vocab-parallel in BF16."""
    p = param_breakdown(m)
    wb, ab = plan.weights.bytes_per_value, plan.attention_weights.bytes_per_value
    replicated = m.hidden * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_dim) if m.is_mla else 0
    attention = replicated + (p.attention_per_layer - replicated) / par.tp
    mlp = m.mlp_layers * p.dense_mlp_per_layer / par.tp
    moe = m.moe_layers * (m.experts * p.expert / par.stage_gpus + p.shared_expert_total / par.tp)
    layers = (m.layers * attention * ab + (mlp + moe) * wb) / par.pp
    embeddings = p.embedding * 2.0 / (par.tp * np.minimum(par.pp, 2))
    return layers + embeddings


def kv_bytes_per_token_per_gpu(m: ModelConfig, par: Parallel, plan: PrecisionPlan) -> np.ndarray:
    """KV one GPU stores per cached token: its layers, its share of KV heads (MLA latent: all of it)."""
    split = np.ones_like(par.tp, dtype=np.float64) if m.is_mla else np.minimum(par.tp, m.kv_heads).astype(np.float64)
    return kv_values_per_token_per_layer(m) * plan.kv.bytes_per_value * (m.layers / par.pp) / split


def kv_capacity_tokens(m: ModelConfig, gpu: GpuSpec, par: Parallel, plan: PrecisionPlan) -> np.ndarray:
    """Tokens of KV one attention-DP rank can cache (0 when the weights alone do not fit)."""
    free = gpu.hbm_gb * GB * (1 - RESERVE_FRACTION) - RESERVE_BYTES - weight_bytes_per_gpu(m, par, plan)
    return np.maximum(free, 0.0) / kv_bytes_per_token_per_gpu(m, par, plan)


def max_sequences(m: ModelConfig, gpu: GpuSpec, par: Parallel, plan: PrecisionPlan, seq_tokens: np.ndarray) -> np.ndarray:
    """Concurrent sequences of `seq_tokens` cached tokens a whole instance can hold."""
    return np.floor(kv_capacity_tokens(m, gpu, par, plan) / np.maximum(seq_tokens, 1)) * par.dp


def memory_per_gpu(m: ModelConfig, par: Parallel, plan: PrecisionPlan, cached_tokens_per_rank: np.ndarray) -> np.ndarray:
    """Bytes one GPU needs for weights + the given KV + reserve (reserve counted as the fixed part)."""
    return weight_bytes_per_gpu(m, par, plan) + cached_tokens_per_rank * kv_bytes_per_token_per_gpu(m, par, plan) + RESERVE_BYTES
