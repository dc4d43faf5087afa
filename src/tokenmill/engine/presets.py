"""Model presets for `tokenmill make-model`: each is the content of an HF `config.json`.

The field names are the ones real hub checkpoints use (`rope_theta` at top level, `head_dim`
spelled out), so a loader that handles these handles downloaded checkpoints too; transformers
5.x turns `rope_theta` into its `rope_parameters` when it reads the file.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from tokenmill.textgen.bpe_tokenizer import SPECIAL_TOKENS

# Token ids fixed by the tokenizer: the special tokens come first in its vocabulary.
ENDOFTEXT_ID = SPECIAL_TOKENS.index("<|endoftext|>")
IM_END_ID = SPECIAL_TOKENS.index("<|im_end|>")


@dataclass(slots=True)
class Preset:
    """One preset: the HF config, the default dtype, and how big the tokenizer is."""

    name: str
    config: dict[str, Any]
    default_dtype: str
    vocab_size: int
    description: str = ""

    def hf_config(self, dtype: str) -> dict[str, Any]:
        """The config.json content for this preset written in `dtype`."""
        cfg = copy.deepcopy(self.config)
        cfg["torch_dtype"] = dtype  # older readers (and our engine) look here
        cfg["dtype"] = dtype  # transformers 5.x's own spelling
        return cfg


def _common(vocab_size: int, max_positions: int, rope_theta: float) -> dict[str, Any]:
    """Fields every preset shares: special token ids, rope, activation."""
    return {
        "vocab_size": vocab_size,
        "max_position_embeddings": max_positions,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
    }


# The tiny presets share one shape so they load and run in well under a second.
_TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16}


def _tiny_dense() -> Preset:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **_TINY_SHAPE,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        **_common(2048, 2048, 10000.0),
    }
    return Preset("tiny-dense", cfg, "float32", 2048, "Qwen3 dense, tied embeddings")


def _llama(shape: dict[str, int], vocab: int, max_positions: int, rope_theta: float,
           attention_bias: bool = False) -> dict[str, Any]:
    """An untied Llama of `shape` (HF Llama's attention_bias puts a bias on q, k, v *and* o_proj)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "attention_bias": attention_bias,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        **_common(vocab, max_positions, rope_theta),
    }


def _tiny_llama() -> Preset:
    cfg = _llama(_TINY_SHAPE, 2048, 2048, 10000.0, attention_bias=True)
    return Preset("tiny-llama", cfg, "float32", 2048, "Llama with attention biases, untied")


def _small_llama() -> Preset:
    """Llama whose head size (64) and block-size needs fit vLLM's CPU attention (it has no kernel for
    the tiny presets' 16): the model of the tests that run tokenmill over vLLM workers."""
    shape = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 64}
    return Preset("small-llama", _llama(shape, 2048, 4096, 10000.0), "float32", 2048,
                  "Llama, head size 64 (runs on vLLM's CPU attention too)")


def _llama_1b() -> Preset:
    """A ~1 B-parameter Llama (Llama 3.2 1B's layer shape, 16 layers, a small vocabulary): the
    GPU check's model, big enough that a decode step reads its weights rather than waits on Python."""
    shape = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 64}
    return Preset("llama-1b", _llama(shape, 8192, 4096, 500000.0), "bfloat16", 8192,
                  "Llama, ~1 B params (scripts/gpu-check)")


def _qwen3_moe(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
               experts: int, moe_inter: int, vocab: int, max_pos: int, theta: float) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        # Unused while every layer is sparse, but dense layers (mlp_only_layers) would use it.
        "intermediate_size": moe_inter * 4,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "attention_bias": False,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": moe_inter,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        **_common(vocab, max_pos, theta),
    }


def _tiny_moe() -> Preset:
    cfg = _qwen3_moe(64, 2, 4, 2, 16, 8, 32, 2048, 2048, 10000.0)
    return Preset("tiny-moe", cfg, "float32", 2048, "Qwen3-MoE, 8 experts top-2")


def _small_moe() -> Preset:
    cfg = _qwen3_moe(512, 8, 8, 4, 64, 16, 512, 8192, 4096, 1_000_000.0)
    return Preset("small-moe", cfg, "bfloat16", 8192, "Qwen3-MoE ~115 M params, for benchmarks")


PRESETS: dict[str, Preset] = {p.name: p for p in (_tiny_dense(), _tiny_llama(), _small_llama(), _tiny_moe(),
                                                   _small_moe(), _llama_1b())}
DTYPES: tuple[str, ...] = ("float32", "bfloat16")


def get_preset(name: str) -> Preset:
    """The preset called `name`; a ValueError naming the field otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset: unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint holds, by its on-disk HF name, with its shape."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        for name, out_dim, in_dim in (("q", q_out, hidden), ("k", kv_out, hidden),
                                      ("v", kv_out, hidden), ("o", hidden, q_out)):
            shapes[f"{p}.self_attn.{name}_proj.weight"] = (out_dim, in_dim)
            if config.get("attention_bias"):
                shapes[f"{p}.self_attn.{name}_proj.bias"] = (out_dim,)
        if config["model_type"] in ("qwen3", "qwen3_moe"):
            shapes[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
        shapes.update(_mlp_shapes(config, i))
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _is_sparse_layer(config: dict[str, Any], layer: int) -> bool:
    """Mirrors Qwen3-MoE's rule for which layers get experts."""
    if config.get("model_type") != "qwen3_moe" or layer in config["mlp_only_layers"]:
        return False
    return config["num_experts"] > 0 and (layer + 1) % config["decoder_sparse_step"] == 0


def _mlp_shapes(config: dict[str, Any], layer: int) -> dict[str, tuple[int, ...]]:
    hidden, p = config["hidden_size"], f"model.layers.{layer}.mlp"
    if not _is_sparse_layer(config, layer):
        inter = config["intermediate_size"]
        return {f"{p}.gate_proj.weight": (inter, hidden), f"{p}.up_proj.weight": (inter, hidden),
                f"{p}.down_proj.weight": (hidden, inter)}
    inter = config["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {f"{p}.gate.weight": (config["num_experts"], hidden)}
    for e in range(config["num_experts"]):
        shapes[f"{p}.experts.{e}.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}.experts.{e}.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}.experts.{e}.down_proj.weight"] = (hidden, inter)
    return shapes


def parameter_count(config: dict[str, Any]) -> int:
    """Number of parameters, counted from the shapes (tied embeddings counted once)."""
    total = 0
    for shape in parameter_shapes(config).values():
        n = 1
        for dim in shape:
            n *= dim
        total += n
    return total
