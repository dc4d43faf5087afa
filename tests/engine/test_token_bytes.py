"""`Tokenizer.token_bytes`: each token's own bytes, so a character split across tokens is whole
again when its tokens' bytes are joined (the decoded text of such a token is only U+FFFD)."""
from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.textgen.token_bytes import TokenBytes
from tokenmill.textgen.tokenizer import Tokenizer


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=40))
def test_joined_token_bytes_are_the_texts_utf8(tiny_dense: Path, text: str) -> None:
    tokenizer = Tokenizer(tiny_dense)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()


def test_a_token_that_is_part_of_a_character(tiny_dense: Path) -> None:
    tokenizer = Tokenizer(tiny_dense)
    ids = tokenizer.encode("\u2603\U0001f600", add_special_tokens=False)  # rare: split into byte tokens
    partial = [t for t in ids if tokenizer.decode([t]) == "\ufffd"]
    assert partial, "the snowman and emoji should need byte-level tokens in this small vocabulary"
    for t in partial:
        raw = tokenizer.token_bytes(t)
        assert raw != "\ufffd".encode()
        try:
            raw.decode()
        except UnicodeDecodeError:
            pass
        else:
            raise AssertionError(f"{raw!r} should not be a whole character")
    assert tokenizer.token_bytes(tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]) == b"<|im_end|>"


def test_sentencepiece_style_byte_fallback_pieces() -> None:
    spec = {"model": {"type": "BPE", "vocab": {"<0xE2>": 0, "\u2581Hi": 1, "a": 2}},
            "decoder": {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]},
            "added_tokens": [{"id": 3, "content": "</s>"}]}
    table = TokenBytes(json.dumps(spec), lambda t: "?")
    assert [table.of(t) for t in range(4)] == [b"\xe2", b" Hi", b"a", b"</s>"]
