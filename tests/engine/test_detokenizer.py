"""Incremental detokenization never splits a multi-byte character."""
from pathlib import Path

from tokenmill.textgen.detokenizer import IncrementalDetokenizer
from tokenmill.textgen.tokenizer import Tokenizer

TEXT = "Anne said: héllo wörld — 世界 🙂🎉 naïve café"


def test_token_by_token_deltas_rebuild_the_text_without_broken_characters(tiny_dense: Path) -> None:
    tok = Tokenizer(tiny_dense)
    prompt = tok.encode("Once upon a time")
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.encode()) // 4  # byte-level pieces: emoji and CJK span several tokens
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT
    assert any(d == "" for d in deltas)  # some tokens were held back mid-character


def test_flush_emits_an_incomplete_tail(tiny_dense: Path) -> None:
    tok = Tokenizer(tiny_dense)
    ids = tok.encode("🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids[:-1]) == ""
    assert detok.flush() != ""


def test_a_continuation_elsewhere_emits_the_text_held_back_mid_character(tiny_dense: Path) -> None:
    tok = Tokenizer(tiny_dense)
    prompt = tok.encode("Once upon a time")
    ids = tok.encode(TEXT, add_special_tokens=False)
    first = IncrementalDetokenizer(tok, prompt)
    cuts = []
    for i, t in enumerate(ids):
        first.add([t])
        if first.pending_tokens:
            cuts.append(i + 1)
    assert cuts  # some prefix ends mid-character
    for cut in cuts:
        before = IncrementalDetokenizer(tok, prompt)
        emitted = "".join(before.add([t]) for t in ids[:cut])
        after = IncrementalDetokenizer(tok, prompt + ids[:cut], pending=before.pending_tokens)
        rest = "".join(after.add([t]) for t in ids[cut:]) + after.flush()
        assert emitted + rest == TEXT
