"""The raw bytes a token stands for (OpenAI's `logprobs[].bytes`).

Decoding one token to text loses what a token that is part of a multi-byte character holds: it
comes back as U+FFFD. The bytes come from the vocabulary instead, read by the decoder the
tokenizer.json declares: byte-level BPE (GPT-2, Llama 3, Qwen) spells each byte as one printable
character; SentencePiece-style vocabularies spell a space as U+2581 and a raw byte as `<0xNN>`.
Added tokens are their content. Any other decoder falls back to the decoded text's UTF-8.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPM_SPACE = "\u2581"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: printable Latin-1 bytes stand for themselves and
    the other 68 bytes take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _decoder_kinds(decoder: Any) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    kinds = {str(decoder.get("type"))}
    for inner in decoder.get("decoders") or []:
        kinds |= _decoder_kinds(inner)
    return kinds


class TokenBytes:
    """`of(token_id)`: the token's bytes (cached per id)."""

    def __init__(self, serialized: str, decode: Callable[[int], str]) -> None:
        spec = json.loads(serialized)
        vocab = spec.get("model", {}).get("vocab")
        pieces: dict[int, str] = {}
        if isinstance(vocab, dict):
            pieces = {int(i): piece for piece, i in vocab.items()}
        elif isinstance(vocab, list):  # Unigram: [piece, score] in id order
            pieces = {i: entry[0] for i, entry in enumerate(vocab)}
        self._added = {int(t["id"]): t["content"].encode() for t in spec.get("added_tokens") or []}
        self._pieces = pieces
        kinds = _decoder_kinds(spec.get("decoder"))
        self._kind = "byte_level" if "ByteLevel" in kinds else "spm" if kinds & {"ByteFallback", "Metaspace"} \
            else "text"
        self._alphabet = _byte_level_alphabet() if self._kind == "byte_level" else {}
        self._decode = decode
        self._cache: dict[int, bytes] = {}

    def of(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id]
        piece = self._pieces.get(token_id)
        if piece is not None and self._kind == "byte_level" and all(ch in self._alphabet for ch in piece):
            return bytes(self._alphabet[ch] for ch in piece)
        if piece is not None and self._kind == "spm":
            match = _BYTE_PIECE.match(piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace(_SPM_SPACE, " ").encode()
        return self._decode(token_id).encode()
