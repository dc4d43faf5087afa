"""Load an HF safetensors checkpoint (single file or sharded) into a `CausalLM`.

HF tensor names are mapped onto tokenmill's fused parameters (q/k/v into
`qkv_proj`, gate/up into `gate_up_proj`, per-expert matrices into stacked expert
tensors). Every expected tensor must be present; a missing or corrupt file is an
error that names the file.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tokenmill.engine.models.moe import SparseMoE
from tokenmill.engine.models.native_linear import NativeLinear
from tokenmill.engine.models.transformer import CausalLM, RotaryEmbedding
from tokenmill.engine.parallel.shard import Shard
from tokenmill.engine.parallel.shard_weights import Index, Part, local_name, source_index
from tokenmill.textgen.model_config import ModelConfig

log = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or does not match config.json."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif single.is_file():
        files = [single]
    else:
        raise CheckpointError(f"{single}: missing (and no model.safetensors.index.json in {model_dir})")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f}: missing safetensors shard named by the index")
    return files


def iter_tensors(files: list[Path], index: Callable[[str], Index] | None = None,
                 ) -> Iterator[tuple[str, torch.Tensor | Part, Path]]:
    """(name, tensor, file) for every tensor; with `index`, only the part it names is read
    (or a `Part` marker instead of a tensor)."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    part = index(name) if index is not None else None
                    if isinstance(part, Part):
                        yield name, part, path
                    else:
                        yield name, f.get_tensor(name) if part is None else f.get_slice(name)[part], path
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({exc})") from exc


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
               shard: Shard | None = None, device: str = "cpu", batch_invariant: bool = False) -> CausalLM:
    """The whole model, or with `shard` one rank's part of it (reading only that part), read into
    host memory and then moved to `device` (packed for the native kernels on the CPU only).
    `batch_invariant`: every matmul takes the native kernels whatever its rows (see
    `NativeLinear`), so that a row's result never depends on the rows beside it."""
    local = cfg if shard is None else shard.local_config(cfg)
    with torch.device("meta"):
        model = CausalLM(local, None if shard is None else shard.experts)
    _materialize(model, dtype)
    model.rotary = RotaryEmbedding(cfg, max_positions)
    params = dict(model.named_parameters())
    expected = set(expected_tensor_names(cfg))
    seen: set[str] = set()
    index = None if shard is None else (lambda n: source_index(shard, cfg, n))
    for name, tensor, path in iter_tensors(checkpoint_files(Path(model_dir)), index):
        dst = None if tensor is Part.SKIP else \
            _destination(name if shard is None else local_name(shard, name), params, local)
        if isinstance(tensor, Part):  # another rank's expert, or a bias only rank 0 adds
            if dst is not None:
                with torch.no_grad():
                    dst.zero_()
            seen.update(_names_covered(name, cfg))
            continue
        if dst is None:
            if not _IGNORED.match(name):
                log.warning("%s: ignoring unexpected tensor %s", path, name)
            continue
        if tuple(dst.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, "
                                  f"config.json implies {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        seen.update(_names_covered(name, cfg))
    _finish_tied(model, cfg, seen, expected)
    missing = sorted(expected - seen)
    if missing:
        raise CheckpointError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    if device == "cpu":
        prepack_weights(model, batch_invariant)
        return model.eval()
    return model.to(device).eval()


def _materialize(model: nn.Module, dtype: torch.dtype) -> None:
    """Each meta parameter and buffer becomes an uninitialised CPU tensor, floating ones in `dtype`.
    (`Module.to_empty` does the same through torch's Python reference of `empty_like`, whose first
    call imports sympy: half a second of every worker's start.)"""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(_empty_like(param, dtype), requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, _empty_like(buffer, dtype))


def _empty_like(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=dtype if tensor.is_floating_point() else tensor.dtype)


def _finish_tied(model: CausalLM, cfg: ModelConfig, seen: set[str], expected: set[str]) -> None:
    if "lm_head.weight" in seen:
        return
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        expected.discard("lm_head.weight")


def _names_covered(name: str, cfg: ModelConfig) -> list[str]:
    """A fused-experts tensor (transformers 5 layout) stands for every per-expert tensor."""
    for fused, parts in ((".mlp.experts.gate_up_proj", ("gate_proj", "up_proj")),
                         (".mlp.experts.down_proj", ("down_proj",))):
        if name.endswith(fused) and cfg.moe is not None:
            prefix = name[: -len(fused)]
            return [f"{prefix}.mlp.experts.{e}.{w}.weight"
                    for e in range(cfg.moe.num_experts) for w in parts]
    return [name]


def expected_tensor_names(cfg: ModelConfig) -> Iterator[str]:
    yield "model.embed_tokens.weight"
    yield "model.norm.weight"
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight"
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        yield from (p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight"))
        for proj in ("q", "k", "v", "o"):
            yield f"{p}self_attn.{proj}_proj.weight"
            if (proj != "o" and cfg.qkv_bias) or (proj == "o" and cfg.o_bias):
                yield f"{p}self_attn.{proj}_proj.bias"
        if cfg.qk_norm:
            yield from (f"{p}self_attn.{n}_norm.weight" for n in ("q", "k"))
        if cfg.moe is not None and i in cfg.moe.sparse_layers:
            yield f"{p}mlp.gate.weight"
            for e in range(cfg.moe.num_experts):
                yield from (f"{p}mlp.experts.{e}.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj"))
        else:
            yield from (f"{p}mlp.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj"))


def _destination(name: str, params: dict[str, torch.nn.Parameter], cfg: ModelConfig) -> torch.Tensor | None:
    """The parameter (or slice of a fused one) that HF tensor `name` fills."""
    top = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "lm_head.weight"}
    if name in top:
        return params[top[name]]
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= cfg.num_layers:
        return None
    return _layer_destination(rest, f"layers.{layer}.", params, cfg)


def _layer_destination(rest: str, p: str, params: dict[str, torch.nn.Parameter],
                       cfg: ModelConfig) -> torch.Tensor | None:
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    qkv_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    parts = rest.split(".")
    if parts[0] == "self_attn" and parts[1] in qkv_rows and p + f"self_attn.qkv_proj.{parts[2]}" in params:
        lo, hi = qkv_rows[parts[1]]
        return params[p + f"self_attn.qkv_proj.{parts[2]}"][lo:hi]
    if parts[0] == "mlp" and parts[1] in ("gate_proj", "up_proj") and p + "mlp.gate_up_proj.weight" in params:
        half = params[p + "mlp.gate_up_proj.weight"].shape[0] // 2
        return params[p + "mlp.gate_up_proj.weight"][:half] if parts[1] == "gate_proj" else \
            params[p + "mlp.gate_up_proj.weight"][half:]
    e = _EXPERT.fullmatch(rest)
    if e is not None and p + "mlp.w_gate_up" in params:
        expert, which = int(e.group(1)), e.group(2)
        if expert >= params[p + "mlp.w_gate_up"].shape[0]:
            return None
        if which == "down_proj":
            return params[p + "mlp.w_down"][expert]
        half = params[p + "mlp.w_gate_up"].shape[1] // 2
        w = params[p + "mlp.w_gate_up"][expert]
        return w[:half] if which == "gate_proj" else w[half:]
    fused = {"mlp.experts.gate_up_proj": "mlp.w_gate_up", "mlp.experts.down_proj": "mlp.w_down"}
    if rest in fused:
        return params.get(p + fused[rest])
    return params.get(p + rest)


def prepack_weights(model: nn.Module, batch_invariant: bool = False) -> None:
    """Pack every MoE layer's expert weights and every native linear's weight (a no-op where
    packing does not apply); after the weights are loaded, so that no request pays for it. Each
    of those modules takes `batch_invariant` here too."""
    for module in model.modules():
        if isinstance(module, (SparseMoE, NativeLinear)):
            module.batch_invariant = batch_invariant
            module.prepack()
