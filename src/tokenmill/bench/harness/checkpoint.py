"""What the benchmarks read from, or adjust in, a checkpoint directory's config files."""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def model_limits(model: str) -> tuple[int, int]:
    """(context length, vocabulary size) from the checkpoint's config.json."""
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
        return int(config["max_position_embeddings"]), int(config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--model {model}: no readable config.json with a context and vocabulary ({exc})") from exc


def fit_context(model: Path, needed: int, owned: bool) -> None:
    """Raise our own checkpoint's context to `needed` (a power of two); refuse a user's that is short."""
    config_path = model / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config["max_position_embeddings"] >= needed:
        return
    if not owned:
        raise ValueError(f"--model {model}: context {config['max_position_embeddings']} < {needed} tokens needed")
    context = 1 << (needed - 1).bit_length()
    config["max_position_embeddings"] = context
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    tok_path = model / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text(encoding="utf-8"))
    tok["model_max_length"] = context  # else every long prompt logs transformers' length warning
    tok_path.write_text(json.dumps(tok, indent=2), encoding="utf-8")
    log.info("raised %s's context to %d tokens (mock runner: weights are never read)", model, context)


def model_or_small_moe(model: str | None, work: Path) -> str:
    """`--model` as given, or (none given) a fresh random-weight small-moe written under `work`."""
    if model is not None:
        return model
    from tokenmill.engine.make_model import write_model

    return str(write_model("small-moe", work / "small-moe", seed=0))
