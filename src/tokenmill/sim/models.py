"""Model catalog: the architecture numbers the step-time model needs, read from HF config.json.

Any HF `config.json` path works (Llama, Qwen3/Qwen3-MoE, Mixtral, DeepSeek-V3/MLA, gpt-oss,
MiniMax-M2 field names); built-ins live in `data/models.json` with their source.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

# Names users (and the silicon CSV's HF paths) use for the built-ins.
MODEL_ALIASES: dict[str, str] = {
    "deepseek-r1": "deepseek-v3", "deepseek-ai/deepseek-r1": "deepseek-v3", "deepseek-ai/deepseek-v3": "deepseek-v3",
    "nvidia/deepseek-r1-nvfp4": "deepseek-v3", "nvidia/deepseek-v3.1-nvfp4": "deepseek-v3",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b", "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b": "llama-3.1-70b", "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/llama-3.1-405b": "llama-3.1-405b",
    "qwen/qwen3-32b": "qwen3-32b", "nvidia/qwen3-32b-nvfp4": "qwen3-32b",
    "qwen/qwen3-235b-a22b": "qwen3-235b-a22b", "qwen/qwen3-235b-a22b-fp8": "qwen3-235b-a22b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b", "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
    "openai/gpt-oss-120b": "gpt-oss-120b", "minimaxai/minimax-m2.5": "minimax-m2", "minimaxai/minimax-m2": "minimax-m2",
    "moonshotai/kimi-k2.5": "kimi-k2", "moonshotai/kimi-k2-instruct": "kimi-k2",
}


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Decoder-only transformer shape. MoE fields are 0 for dense models, MLA fields 0 for GQA."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP intermediate size
    vocab: int
    tied_embeddings: bool = False
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # leading dense layers in an MoE model
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    sliding_fraction: float = 0.0
    mtp_modules: int = 0  # multi-token-prediction modules shipped with the checkpoint (DeepSeek-V3: 1)

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "vocab"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {self.name}: field {name} must be > 0")
        if self.experts and not 0 < self.top_k <= self.experts:
            raise ValueError(f"model {self.name}: field top_k must be in 1..experts")
        if self.dense_layers > self.layers:
            raise ValueError(f"model {self.name}: field dense_layers exceeds layers")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def mlp_layers(self) -> int:
        """Layers with a dense MLP (all of them for a dense model)."""
        return self.dense_layers if self.is_moe else self.layers


def _first(cfg: dict, *keys: str, default: int | float = 0) -> int | float:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def from_hf_config(cfg: dict, name: str) -> ModelConfig:
    """Build a ModelConfig from a parsed HF config.json dictionary."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    experts = int(_first(cfg, "n_routed_experts", "num_experts", "num_local_experts"))
    ffn = int(_first(cfg, "intermediate_size"))
    expert_ffn = int(_first(cfg, "moe_intermediate_size", default=ffn)) if experts else 0
    sliding = int(_first(cfg, "sliding_window") or 0) if cfg.get("use_sliding_window", True) else 0
    return ModelConfig(
        name=name, hidden=hidden, layers=int(cfg["num_hidden_layers"]), heads=heads,
        kv_heads=int(_first(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_first(cfg, "head_dim", default=hidden // heads)), ffn=ffn,
        vocab=int(cfg["vocab_size"]), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        experts=experts, top_k=int(_first(cfg, "num_experts_per_tok", "experts_per_token")) if experts else 0,
        expert_ffn=expert_ffn, shared_experts=int(_first(cfg, "n_shared_experts")),
        dense_layers=int(_first(cfg, "first_k_dense_replace")) if experts else 0,
        q_lora_rank=int(_first(cfg, "q_lora_rank") or 0), kv_lora_rank=int(_first(cfg, "kv_lora_rank") or 0),
        qk_nope_dim=int(_first(cfg, "qk_nope_head_dim")), qk_rope_dim=int(_first(cfg, "qk_rope_head_dim")),
        v_head_dim=int(_first(cfg, "v_head_dim")), sliding_window=sliding,
        sliding_fraction=float(_first(cfg, "sliding_window_layer_fraction", default=1.0 if sliding else 0.0)),
        mtp_modules=int(_first(cfg, "num_nextn_predict_layers")),
    )


def builtin_model_names() -> list[str]:
    return sorted(k for k in _builtin_table() if not k.startswith("_"))


def _builtin_table() -> dict[str, dict]:
    return json.loads(resources.files("tokenmill.sim").joinpath("data/models.json").read_text())


def get_model(name_or_path: str) -> ModelConfig:
    """A built-in name (or alias, or HF repo id of one), a config.json path, or a checkpoint directory."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return from_hf_config(json.loads(path.read_text()), name=path.parent.name or str(path))
    key = MODEL_ALIASES.get(name_or_path.lower(), name_or_path.lower())
    table = _builtin_table()
    if key not in table or key.startswith("_"):
        raise ValueError(f"model {name_or_path!r}: not a config.json path nor a built-in {builtin_model_names()}")
    return from_hf_config(table[key], name=key)
