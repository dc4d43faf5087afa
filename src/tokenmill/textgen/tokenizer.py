"""Tokenizer and chat template from a checkpoint directory (incremental detokenization:
`detokenizer.py`).

Every frontend and mock worker loads a Tokenizer, and transformers' `AutoTokenizer` costs ~3 s
and ~250 MB per process (it imports torch). So the common checkpoint, a `tokenizer.json` that
transformers would load as a plain `TokenizersBackend`, is read with the `tokenizers` library
directly (tens of ms) and its chat template rendered by `chat_template.py`. Each step that
transformers applies on top of tokenizer.json (re-adding tokenizer_config's added tokens, named
special tokens, `split_special_tokens`, a default post-processor) is repeated here with the same
`tokenizers` calls, so ids and text are identical. A checkpoint needing anything else (no
tokenizer.json, a model-specific tokenizer class, decode clean-up, ...) goes through transformers
as before; `Tokenizer.backend` says which one a checkpoint got.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.textgen.token_bytes import TokenBytes

if TYPE_CHECKING:
    import tokenizers

log = logging.getLogger(__name__)

# tokenizer_class values that AutoTokenizer resolves to the plain TokenizersBackend.
_PLAIN_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# Named special tokens, in the order transformers lists them.
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Model types for which AutoTokenizer ignores a plain tokenizer_class and builds the model's own
# tokenizer class (transformers 5.24, tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS;
# a test keeps this a superset of the installed version's list).
_CLASS_OVERRIDE_MODEL_TYPES = frozenset({
    "arctic", "camembertv2-base", "chatlm", "cohere_asr", "ernie4_5", "ernie4_5_moe", "fuyu", "h2ovl_chat",
    "hyperclovax", "hyperclovax_vision_v2", "hyperclovax_vlm", "internlm2", "internlm3", "iquestcoder", "jamba",
    "llava", "llava_next", "minicpm3", "minicpmv", "minimax_m2", "modernbert", "modernbert-decoder", "molmo",
    "molmo2", "nemotron", "nvfp4", "opencua", "openvla", "paddleocr_vl", "phi3", "phi3_v", "phimoe", "qwen2",
    "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "siglip2", "smolvlm", "step3_vl", "vipllava",
})


class _NeedsTransformers(Exception):
    """The checkpoint needs loading behaviour that only transformers reproduces (the reason)."""


class _Backend(Protocol):
    """What Tokenizer needs from a loaded tokenizer, whichever library loaded it."""

    name: str
    special_token_ids: frozenset[int]
    eos_token_id: int | None

    @property
    def vocab_size(self) -> int: ...
    @property
    def has_chat_template(self) -> bool: ...
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str: ...
    def render_chat(self, messages: Any, add_generation_prompt: bool, **kwargs: Any) -> str: ...


@dataclass(slots=True)
class _SpecialTokens:
    """tokenizer_config.json's special tokens as transformers 5 reads them."""

    named: dict[str, str]  # bos_token, eos_token, ... and model-specific `*_token` keys -> text
    extra: list[str]  # extra_special_tokens (formerly additional_special_tokens)

    @property
    def all_tokens(self) -> list[str]:
        """What `all_special_ids` counts: named and extra tokens, not every special added token."""
        return list(dict.fromkeys([*self.named.values(), *self.extra]))


def _token_text(value: Any) -> str:
    """A special-token value as text: a string, or a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("__type") == "AddedToken" and isinstance(value.get("content"), str):
        return value["content"]
    raise _NeedsTransformers(f"special token value {value!r}")


def _is_token_value(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, dict) and value.get("__type") == "AddedToken")


def _read_special_tokens(cfg: dict[str, Any]) -> _SpecialTokens:
    """Named tokens, model-specific `*_token` keys and extra tokens, with transformers' precedence."""
    named = {key: _token_text(cfg[key]) for key in _NAMED_SPECIALS if cfg.get(key) is not None}
    named.update({key: _token_text(value) for key, value in cfg.items()
                  if key.endswith("_token") and key not in _NAMED_SPECIALS and _is_token_value(value)})
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # a dict names model-specific tokens
        named.update({key: _token_text(value) for key, value in extra.items()})
        extra = []
    if not isinstance(extra, list):
        raise _NeedsTransformers(f"extra_special_tokens {extra!r}")
    return _SpecialTokens(named, [_token_text(value) for value in extra])


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path.name}: expected a JSON object")
    return data


def _transformers_only_reason(model_dir: Path, cfg: dict[str, Any], model_cfg: dict[str, Any]) -> str | None:
    """Why AutoTokenizer would do more than load tokenizer.json as a TokenizersBackend (None: it wouldn't)."""
    model_type, tokenizer_class = model_cfg.get("model_type"), cfg.get("tokenizer_class")
    checks = (
        (tokenizer_class not in _PLAIN_TOKENIZER_CLASSES, f"tokenizer_class {tokenizer_class!r}"),
        ("auto_map" in cfg, "custom tokenizer code (auto_map)"),
        (model_type in _CLASS_OVERRIDE_MODEL_TYPES or model_cfg.get("model_name") in _CLASS_OVERRIDE_MODEL_TYPES,
         f"transformers picks its own tokenizer class for model_type {model_type!r}"),
        ((model_dir / "tekken.json").exists(), "a Mistral tekken.json"),
        ("added_tokens_decoder" not in cfg, "legacy special-token files (no added_tokens_decoder)"),
        (bool(cfg.get("clean_up_tokenization_spaces")), "clean_up_tokenization_spaces"),
        (bool(cfg.get("add_bos_token") or cfg.get("add_eos_token")), "add_bos_token/add_eos_token"),
        (not isinstance(cfg.get("split_special_tokens", False), bool), "a non-boolean split_special_tokens"),
        (any(key in cfg for key in ("fast_tokenizer_files", "fix_mistral_regex", "model_specific_special_tokens")),
         "fast_tokenizer_files, fix_mistral_regex or model_specific_special_tokens"),
    )
    return next((reason for hit, reason in checks if hit), None)


def _chat_templates(model_dir: Path, cfg: dict[str, Any]) -> str | dict[str, str] | None:
    """The chat template(s): chat_template.jinja and additional_chat_templates/*.jinja take priority
    over tokenizer_config's `chat_template` (a string, or a list of named templates)."""
    found: dict[str, str] = {}
    if (model_dir / "chat_template.jinja").is_file():
        found["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if (model_dir / "additional_chat_templates").is_dir():
        for path in sorted((model_dir / "additional_chat_templates").glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if found:
        return found["default"] if list(found) == ["default"] else found
    template = cfg.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return template


def _prepare_rust_tokenizer(tok: tokenizers.Tokenizer, cfg: dict[str, Any], specials: _SpecialTokens) -> None:
    """Apply what TokenizersBackend.__init__ applies to the tokenizer.json it loaded."""
    from tokenizers import AddedToken, processors

    if tok.truncation is not None or tok.padding is not None:
        raise _NeedsTransformers("tokenizer.json enables truncation or padding")
    named = set(specials.named.values())
    added = []
    # transformers re-adds every added_tokens_decoder entry, in id order, named ones made special.
    for _, entry in sorted(cfg["added_tokens_decoder"].items(), key=lambda item: int(item[0])):
        token = AddedToken(**entry)
        if not token.special and token.content in named:
            token.special = True
        added.append(token)
    tok.add_tokens(added)
    present = {t.content for t in tok.get_added_tokens_decoder().values()}
    if missing := [t for t in specials.all_tokens if t not in present]:
        raise _NeedsTransformers(f"special tokens {missing} are not added tokens")
    tok.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
    if tok.post_processor is None:  # transformers installs one that adds nothing to a single text
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])


class _RustBackend:
    """tokenizer.json through the `tokenizers` library, chat templates through chat_template.py."""

    name = "tokenizers"

    def __init__(self, tok: tokenizers.Tokenizer, specials: _SpecialTokens,
                 templates: str | dict[str, str] | None) -> None:
        self._tok = tok
        self._specials = specials
        self._templates = templates
        unk = specials.named.get("unk_token")
        self._unk_id = None if unk is None else tok.token_to_id(unk)
        self.special_token_ids = frozenset(self._token_id(t) for t in specials.all_tokens)
        eos = specials.named.get("eos_token")
        self.eos_token_id = None if eos is None else self._token_id(eos)

    @classmethod
    def load(cls, model_dir: Path) -> _RustBackend:
        """The backend, or _NeedsTransformers when the checkpoint needs transformers' loader."""
        from tokenizers import Tokenizer as RustTokenizer

        if not (model_dir / "tokenizer.json").is_file():
            raise _NeedsTransformers("no tokenizer.json")
        if not (model_dir / "tokenizer_config.json").is_file() or not (model_dir / "config.json").is_file():
            raise _NeedsTransformers("no tokenizer_config.json or config.json")
        cfg = _read_json(model_dir / "tokenizer_config.json")
        if reason := _transformers_only_reason(model_dir, cfg, _read_json(model_dir / "config.json")):
            raise _NeedsTransformers(reason)
        specials = _read_special_tokens(cfg)
        try:
            tok = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as exc:  # the Rust error type is a bare Exception
            raise ValueError(f"tokenizer.json: {exc}") from exc
        try:
            _prepare_rust_tokenizer(tok, cfg, specials)
        except (TypeError, AttributeError) as exc:  # an unusual added_tokens_decoder entry
            raise _NeedsTransformers(f"added_tokens_decoder: {exc}") from exc
        return cls(tok, specials, _chat_templates(model_dir, cfg))

    def _token_id(self, token: str) -> int | None:
        token_id = self._tok.token_to_id(token)
        return self._unk_id if token_id is None else token_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def serialized(self) -> str:
        return self._tok.to_str()

    def render_chat(self, messages: Any, add_generation_prompt: bool, **kwargs: Any) -> str:
        # Imported here: jinja2's sandbox costs ~30 ms, and mock workers never render a chat.
        from tokenmill.textgen.chat_template import render_conversation

        assert self._templates
        return render_conversation(self._templates, messages, self._specials.named,
                                   add_generation_prompt=add_generation_prompt, **kwargs)


class _TransformersBackend:
    """transformers' AutoTokenizer, for checkpoints the `tokenizers` path does not reproduce."""

    name = "transformers"

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer  # heavy import (torch), only for these checkpoints

        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{model_dir}: cannot load the tokenizer ({exc})") from exc
        self.special_token_ids = frozenset(self.hf.all_special_ids)
        self.eos_token_id = self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Any, add_generation_prompt: bool, **kwargs: Any) -> str:
        import jinja2

        try:
            return self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=add_generation_prompt, **kwargs)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template: {exc}") from exc


def _load_backend(model_dir: Path) -> _Backend:
    """The `tokenizers` backend when it reproduces transformers exactly, else transformers."""
    try:
        return _RustBackend.load(model_dir)
    except _NeedsTransformers as why:
        log.info("%s: loading the tokenizer through transformers (%s)", model_dir, why)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{model_dir}: cannot load the tokenizer ({exc})") from exc
    return _TransformersBackend(model_dir)


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, chat template, eos and special token ids."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._backend = _load_backend(self.model_dir)
        self._hf: Any = None
        self._token_bytes: TokenBytes | None = None
        self.eos_token_ids = frozenset(self._eos_ids())
        self.special_token_ids = self._backend.special_token_ids

    @property
    def backend(self) -> str:
        """"tokenizers" (fast start) or "transformers" (a checkpoint only transformers loads exactly)."""
        return self._backend.name

    @property
    def hf(self) -> Any:
        """transformers' tokenizer for this checkpoint; loads it (importing torch, ~3 s) on first use."""
        if isinstance(self._backend, _TransformersBackend):
            return self._backend.hf
        if self._hf is None:
            self._hf = _TransformersBackend(self.model_dir).hf
        return self._hf

    @property
    def vocab_size(self) -> int:
        """The full vocabulary, added tokens included (transformers' `len(tokenizer)`)."""
        return self._backend.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes `token_id` stands for (part of a character, for some byte-level tokens)."""
        if self._token_bytes is None:
            try:
                serialized = self.serialized()
            except ValueError:  # a slow tokenizer: its decoded text is all there is
                serialized = "{}"
            self._token_bytes = TokenBytes(serialized, lambda t: self.decode([t], skip_special_tokens=False))
        return self._token_bytes.of(token_id)

    @property
    def chat_template_text(self) -> str:
        """The chat template's source (every named template, joined); "" without one."""
        if isinstance(self._backend, _RustBackend):
            templates = self._backend._templates
        else:
            templates = getattr(self._backend.hf, "chat_template", None)
        if isinstance(templates, dict):
            return "\n".join(templates.values())
        return templates or ""

    def serialized(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar engine builds its token trie from)."""
        if isinstance(self._backend, _RustBackend):
            return self._backend.serialized()
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{self.model_dir}: a slow tokenizer cannot drive structured outputs")
        return backend.to_str()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        """The prompt ids for a conversation; ValueError without a template or on a template error.

        `kwargs` reach the template (tools, documents, enable_thinking, ...) as in transformers.
        """
        if not self._backend.has_chat_template:
            raise ValueError(f"{self.model_dir}: the tokenizer has no chat_template")
        text = self._backend.render_chat(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _eos_ids(self) -> set[int]:
        """tokenizer_config's eos_token plus generation_config's eos_token_id (int or list)."""
        ids: set[int] = set()
        if self._backend.eos_token_id is not None:
            ids.add(int(self._backend.eos_token_id))
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        return ids
