"""`tokenmill make-model`: write a small random-weight checkpoint in HF format.

The directory holds what a hub download holds: `config.json`, `generation_config.json`,
`model.safetensors` (or shards plus `model.safetensors.index.json`), `tokenizer.json` and
`tokenizer_config.json`. Weights are written per tensor under HF's on-disk names (MoE experts one
tensor per expert and projection, as the Qwen3-MoE hub checkpoints store them), never through
transformers, so the format is ours to guarantee.

Initialisation is deliberately *not* HF's std=0.02: engine tests compare greedy continuations
with transformers, and near-flat logits would let rounding noise flip the argmax. Projections
use std 1/sqrt(fan_in), embeddings std 1, norms scatter around 1, and the router is sharpened,
so logits spread over several units and top-1/top-2 gaps are rarely tiny.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.engine import presets
from tokenmill.textgen.bpe_tokenizer import write_tokenizer

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "model.safetensors", "model.safetensors.index.json")
NORM_JITTER = 0.2  # norm weights ~ 1 ± this, so a loader that ignores them is caught
BIAS_STD = 0.2
ROUTER_GAIN = 3.0  # router logits std ~3: clear top-k choices, few near-ties
LM_HEAD_GAIN = 8.0  # untied lm_head: logits std ~8 on a unit-RMS final hidden state
# Attention and MLP outputs outweigh the token embedding in the residual stream; otherwise a
# tied model mostly predicts its input token again and greedy text repeats one token forever.
RESIDUAL_GAIN = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, choices=sorted(presets.PRESETS), help="model shape")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    parser.add_argument("--dtype", choices=presets.DTYPES, default=None, help="default: the preset's")
    parser.add_argument("--max-shard-mb", type=int, default=None,
                        help="write shards of at most this size with a model.safetensors.index.json")
    parser.add_argument("--force", action="store_true", help="overwrite a checkpoint already in --out")


def run(args: argparse.Namespace) -> int:
    out = write_model(args.preset, args.out, seed=args.seed, dtype=args.dtype,
                      max_shard_mb=args.max_shard_mb, force=args.force)
    print(out)
    return 0


def write_model(preset: str, out: Path, seed: int = 0, dtype: str | None = None,
                max_shard_mb: int | None = None, force: bool = False) -> Path:
    """Write the checkpoint for `preset` into `out` and return `out`."""
    spec = presets.get_preset(preset)
    dtype = dtype or spec.default_dtype
    _check_options(seed, dtype, max_shard_mb)
    out = Path(out)
    _prepare_out_dir(out, force)
    config = spec.hf_config(dtype)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(config))
    write_tokenizer(out, spec.vocab_size, config["max_position_embeddings"])
    tensors = random_weights(config, seed, dtype)
    if max_shard_mb is None:
        _save(tensors, out / "model.safetensors")
    else:
        write_sharded(tensors, out, max_shard_mb * 1024 * 1024)
    log.info("wrote %s (%s, %d parameters, %s, seed %d) to %s", preset, config["architectures"][0],
             presets.parameter_count(config), dtype, seed, out)
    return out


def _check_options(seed: int, dtype: str, max_shard_mb: int | None) -> None:
    if seed < 0:
        raise ValueError(f"seed: must be >= 0, got {seed}")
    if dtype not in presets.DTYPES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}; choose one of {', '.join(presets.DTYPES)}")
    if max_shard_mb is not None and max_shard_mb <= 0:
        raise ValueError(f"max_shard_mb: must be positive, got {max_shard_mb}")


def _prepare_out_dir(out: Path, force: bool) -> None:
    """Create `out`; refuse a non-empty one unless forced, then clear only checkpoint files."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    if not any(out.iterdir()):
        return
    if not force:
        raise ValueError(f"out: {out} is not empty (pass --force / force=True to overwrite)")
    # Stale shards from an earlier write would confuse loaders; other files are the user's.
    for path in [*out.glob("model-*-of-*.safetensors"), *(out / name for name in CHECKPOINT_FILES)]:
        path.unlink(missing_ok=True)


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: stop on <|im_end|> and <|endoftext|>; greedy unless asked."""
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [config["eos_token_id"], config["pad_token_id"]],
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
    }


def _init_std(name: str, shape: tuple[int, ...], config: dict[str, Any]) -> float:
    """Standard deviation of the normal init for the weight matrix `name`."""
    if name == "model.embed_tokens.weight":
        return 1.0
    if name == "lm_head.weight":
        return LM_HEAD_GAIN / math.sqrt(config["hidden_size"])
    if name.endswith("mlp.gate.weight"):
        return ROUTER_GAIN / math.sqrt(shape[1])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return RESIDUAL_GAIN / math.sqrt(shape[1])
    return 1.0 / math.sqrt(shape[1])  # fan_in: keeps each projection's output at unit scale


def random_weights(config: dict[str, Any], seed: int, dtype: str) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, drawn in name order from one seeded generator."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    target = getattr(torch, dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in presets.parameter_shapes(config).items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name == "model.norm.weight" and config["tie_word_embeddings"]:
            # Zero-mean final norm: with tied embeddings a unit norm makes each token score its
            # own embedding |e|^2 high, and greedy decoding locks onto repeating one token.
            value = noise
        elif name.endswith("norm.weight"):
            value = 1.0 + NORM_JITTER * noise
        elif name.endswith(".bias"):
            value = BIAS_STD * noise
        else:
            value = noise * _init_std(name, shape, config)
        tensors[name] = value.to(target).contiguous()
    return tensors


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def write_sharded(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> list[Path]:
    """HF sharding: model-0000i-of-0000n.safetensors plus model.safetensors.index.json.

    Tensors are packed in order; a shard closes before a tensor that would overflow it, and a
    tensor bigger than the limit gets a shard of its own (HF does the same).
    """
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    weight_map: dict[str, str] = {}
    paths: list[Path] = []
    for index, shard in enumerate(shards, start=1):
        path = out / f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, path)
        paths.append(path)
        weight_map.update({name: path.name for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return paths


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
