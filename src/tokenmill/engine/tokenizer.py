"""Tokenizer and chat template from a checkpoint directory, and incremental detokenization.

Loads through transformers' `AutoTokenizer`, so a checkpoint a user downloaded
(tokenizer.json + tokenizer_config.json with `chat_template`) works unchanged.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Context tokens re-decoded before new ones, so word-boundary spaces come out right.
_DETOKENIZE_CONTEXT = 5


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import, only when a tokenizer is needed

        self.model_dir = Path(model_dir)
        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{model_dir}: cannot load the tokenizer ({exc})") from exc
        self.eos_token_ids = frozenset(self._eos_ids())
        self.special_token_ids = frozenset(self.hf.all_special_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"{self.model_dir}: the tokenizer has no chat_template")
        text = self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        return ids


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never splitting a multi-byte character."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 pending: int = 0) -> None:
        """`pending`: the prompt's last tokens whose text was never emitted (a migrated request's
        tail held back mid-character); their text comes out with the next delta."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-(_DETOKENIZE_CONTEXT + pending):])
        self.read_offset = len(self.ids) - min(pending, len(self.ids))
        self.prefix_offset = max(0, self.read_offset - _DETOKENIZE_CONTEXT)

    @property
    def pending_tokens(self) -> int:
        """Tokens added whose text has not been emitted yet."""
        return len(self.ids) - self.read_offset

    def add(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
