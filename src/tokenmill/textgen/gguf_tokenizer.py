"""The tokenizer a GGUF file describes, as HF's `tokenizer.json` and `tokenizer_config.json`.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the merges, each token's type
and the special token ids as `tokenizer.ggml.*` metadata, and names its pre-tokenizer by a short
key (`tokenizer.ggml.pre`) that selects regexes compiled into llama.cpp. This module rebuilds the
equivalent `tokenizers` pipeline for the byte-level BPE vocabularies (`tokenizer.ggml.model` =
"gpt2") whose pre-tokenizer it knows; anything else is refused by name rather than guessed.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# llama.cpp's token types (llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

# tokenizer.ggml.pre -> whether digits are split off one by one before the GPT-2 regex (which is
# ByteLevel's). "smollm": llama.cpp (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM) runs `\p{N}`
# then the GPT-2 regex; SmolLM2's own tokenizer.json says the same as Digits(individual_digits) +
# ByteLevel. A file without the key gets llama.cpp's "default" splitting, which has no
# `tokenizers` equivalent here, so it is refused like any other unknown value.
PRE_TOKENIZERS: dict[str, bool] = {"gpt-2": False, "smollm": True}

# tokenizer_config.json key -> GGUF metadata key holding that token's id
_NAMED_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """The `tokenizers` Tokenizer for the vocabulary in `meta` (GGUF metadata, decoded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"tokenizer.ggml.tokens: {len(tokens) - len(vocab)} duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta, vocab), fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens, processors)
    tok.add_tokens(_added_tokens(meta, tokens))
    return tok


def _merges(meta: Mapping[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
    merges = []
    for rank, line in enumerate(meta.get("tokenizer.ggml.merges") or []):
        parts = line.split(" ")
        # a byte-level token spells a space as "Ġ", so a merge line is exactly two tokens
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
            raise ValueError(f"tokenizer.ggml.merges[{rank}]: {line!r} is not two vocabulary tokens")
        merges.append((parts[0], parts[1]))
    if not merges:
        raise ValueError("tokenizer.ggml.merges: missing or empty (a gpt2 BPE vocabulary needs its merges)")
    return merges


def _added_tokens(meta: Mapping[str, Any], tokens: list[str]) -> list[Any]:
    """Control tokens as special added tokens, user-defined ones as plain added tokens: llama.cpp
    matches both whole in the text, so they must never be cut by BPE."""
    from tokenizers import AddedToken

    types: list[int] = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    return [AddedToken(token, special=kind == TOKEN_CONTROL, normalized=False)
            for token, kind in zip(tokens, types) if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]


def _post_processor(meta: Mapping[str, Any], tokens: list[str], processors: Any) -> Any:
    """ByteLevel offsets, plus BOS/EOS around a text when the file asks llama.cpp to add them."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos = _token_id(meta, "tokenizer.ggml.bos_token_id", tokens) if meta.get("tokenizer.ggml.add_bos_token") else None
    eos = _token_id(meta, "tokenizer.ggml.eos_token_id", tokens) if meta.get("tokenizer.ggml.add_eos_token") else None
    if bos is None and eos is None:
        return byte_level
    head = [f"{tokens[bos]}:0"] if bos is not None else []
    single = [*head, "$A:0", *([f"{tokens[eos]}:0"] if eos is not None else [])]
    pair = [*single, "$B:1", *([f"{tokens[eos]}:1"] if eos is not None else [])]
    template = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair),
        special_tokens=[(tokens[i], i) for i in dict.fromkeys((bos, eos)) if i is not None])
    return processors.Sequence([byte_level, template])


def _token_id(meta: Mapping[str, Any], key: str, tokens: list[str]) -> int:
    token_id = int(meta[key])
    if not 0 <= token_id < len(tokens):
        raise ValueError(f"{key} = {token_id} is outside the vocabulary of {len(tokens)} tokens")
    return token_id


def named_token_ids(meta: Mapping[str, Any]) -> dict[str, int]:
    """bos/eos/unk/pad token ids the file names (a key it lacks is left out)."""
    tokens = meta["tokenizer.ggml.tokens"]
    return {name: _token_id(meta, key, tokens) for name, key in _NAMED_TOKEN_IDS.items() if key in meta}


def tokenizer_config(meta: Mapping[str, Any], tok: Tokenizer, context_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the named special tokens, every added token, the chat template.

    The class is the plain PreTrainedTokenizerFast, so transformers (and tokenmill) load
    tokenizer.json exactly as written instead of rebuilding a model-specific pipeline; BOS/EOS
    insertion, if any, lives in tokenizer.json's post-processor, not in add_bos_token."""
    tokens = meta["tokenizer.ggml.tokens"]
    added = {str(index): {"content": token.content, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": token.special}
             for index, token in sorted(tok.get_added_tokens_decoder().items())}
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        **{name: tokens[index] for name, index in named_token_ids(meta).items()},
        # llama.cpp does not clean up spaces around punctuation when it decodes these vocabularies
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return cfg


def write_tokenizer_files(meta: Mapping[str, Any], out: Path, context_length: int) -> Tokenizer:
    """Write tokenizer.json and tokenizer_config.json into `out`; return the tokenizer."""
    tok = build_tokenizer(meta)
    tok.save(str(out / "tokenizer.json"))
    cfg = tokenizer_config(meta, tok, context_length)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return tok
