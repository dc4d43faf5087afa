"""What tokenmill needs to know about a checkpoint, read from its HF `config.json`."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# HF architecture name -> the tokenmill model family that implements it
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


@dataclass(slots=True, frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: frozenset[int]


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    checkpoint_dtype: str
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    moe: MoEConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers at 2 bytes per value."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the model directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    return parse_model_config(raw, source=str(path))


def parse_model_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"{source}: unsupported architecture {archs!r}; tokenmill supports "
            + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    try:
        return _build(raw, arch, family)
    except KeyError as exc:
        raise ValueError(f"{source}: missing required field {exc.args[0]!r} for {arch}") from exc


def _build(raw: dict[str, Any], arch: str, family: str) -> ModelConfig:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "llama3", "linear"):
        raise ValueError(f"rope type {rope.get('rope_type')!r} is not supported")
    attention_bias = bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM"))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
    window = raw.get("sliding_window") if raw.get("use_sliding_window", arch == "MistralForCausalLM") else None
    return ModelConfig(
        architecture=arch, family=family,
        vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
        num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw.get("intermediate_size") or 0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=rope,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias and arch == "LlamaForCausalLM",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        checkpoint_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        moe=_moe(raw) if family == "qwen3_moe" else None,
        eos_token_ids=eos_ids,
        sliding_window=int(window) if window else None,
    )


def _moe(raw: dict[str, Any]) -> MoEConfig:
    layers = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step", 1))
    mlp_only = set(raw.get("mlp_only_layers") or [])
    num_experts = int(raw["num_experts"])
    sparse = frozenset(i for i in range(layers)
                       if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0)
    return MoEConfig(
        num_experts=num_experts, top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)), sparse_layers=sparse,
    )
