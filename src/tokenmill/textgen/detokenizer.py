"""Token deltas to text deltas, as a stream grows, without splitting a multi-byte character."""
from __future__ import annotations

from collections.abc import Sequence

from tokenmill.textgen.tokenizer import Tokenizer

# Context tokens re-decoded before new ones, so word-boundary spaces come out right.
_DETOKENIZE_CONTEXT = 5


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
