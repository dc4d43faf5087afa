"""Speculative decoding: draft a few tokens cheaply, verify them in one forward pass.

    spec = SpeculativeConfig.parse("ngram", num_tokens=4)     # --speculative, --num-speculative-tokens
    spec = SpeculativeConfig.parse("draft:DIR", None)         # or a small model with the same vocabulary
    drafter = Drafter(spec, max_model_len, draft_model)       # the engine's (spec None: drafts nothing)
    accepted = drafter.verify(request, num_drafts, rows)      # rows: (token, logprob) per sampled row
    drafter.propose(requests, live)                           # each one's draft_token_ids for its next step

A decoding request with drafts d_1..d_k computes its last token and the drafts in one step
(k + 1 rows). The row before draft position i gives p_i, the target model's distribution for
that position given all before it (d_1..d_{i-1} included), and the target's token t_i is sampled
from p_i exactly as without speculation (same penalties, same per-position seed); the last row
gives t_{k+1}. Drafts are deterministic proposals (a point mass q_i on d_i: prompt lookup's, or
a draft model's greedy tokens), for which
rejection sampling accepts d_i with probability min(1, p_i(d_i)/q_i(d_i)) = p_i(d_i) and, on
rejection, draws from p_i with d_i removed. Accepting d_i exactly when
t_i == d_i, and emitting t_i at the first mismatch, is that same rule:

    P(accept d_i) = P(t_i = d_i) = p_i(d_i)        P(emit x | rejected) = p_i(x) / (1 - p_i(d_i)), x != d_i

so every emitted token follows the target distribution, greedy output is identical with and
without speculation, and a seeded request gives the same tokens either way (each position
keeps its own seed stream). A step with a accepted drafts emits a + 1 tokens: d_1..d_a and t_{a+1}.
"""
from __future__ import annotations

import json
from collections.abc import Container, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tokenmill.textgen.model_config import load_model_config

if TYPE_CHECKING:
    from tokenmill.engine.request import Request

METHODS = ("ngram", "draft:DIR")
MAX_SPECULATIVE_TOKENS = 16
MAX_DRAFT_PAUSE = 15  # steps (pause_after)
# Prompt lookup drafts K tokens from a match at least this long, n tokens from a shorter n-gram
# match (trusted_drafts).
TRUSTED_MATCH = 3


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # or "draft"
    num_tokens: int = 4  # the most drafts a request proposes for a step (trusted_drafts, next_draft_limit)
    min_ngram: int = 1  # prompt lookup: match the last n tokens, n from max_ngram down to min_ngram
    max_ngram: int = 5
    draft_model: str | None = None  # the draft model's checkpoint directory (method "draft")

    @classmethod
    def parse(cls, method: str | None, num_tokens: int | None) -> SpeculativeConfig | None:
        """From the flags; ValueError naming the flag for a bad value. None: no speculation."""
        if method is None:
            if num_tokens is not None:
                raise ValueError("--num-speculative-tokens needs --speculative (ngram or draft:DIR)")
            return None
        draft = method.removeprefix("draft:") if method.startswith("draft:") else None
        if draft is None and method != "ngram":
            raise ValueError(f"--speculative must be one of {', '.join(METHODS)}, got {method!r}")
        if draft is not None and not (draft and (Path(draft) / "config.json").is_file()):
            raise ValueError(f"--speculative draft:DIR: {draft!r} is not a model directory (no config.json)")
        k = 4 if num_tokens is None else num_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        return cls("ngram", k) if draft is None else cls("draft", k, draft_model=draft)


def check_draft_model(target: str, draft: str) -> None:
    """A draft model must speak the target's vocabulary: the same vocabulary size and, where both
    ship a tokenizer.json, the same token ids. ValueError naming the flag otherwise."""
    try:
        draft_vocab = load_model_config(draft).vocab_size
    except (ValueError, OSError) as exc:
        raise ValueError(f"--speculative draft:DIR: {exc}") from exc
    target_vocab = load_model_config(target).vocab_size
    if target_vocab != draft_vocab:
        raise ValueError(f"--speculative draft:DIR: the draft's vocabulary has {draft_vocab} tokens, "
                         f"the model's {target_vocab}; a draft model must share the model's tokenizer")
    files = [Path(target) / "tokenizer.json", Path(draft) / "tokenizer.json"]
    if all(f.is_file() for f in files):
        vocabs = [json.loads(f.read_text()).get("model", {}).get("vocab") for f in files]
        if vocabs[0] != vocabs[1]:
            raise ValueError("--speculative draft:DIR: the draft's tokenizer.json maps tokens to other ids "
                             "than the model's; a draft model must share the model's tokenizer")


def propose_ngram(token_ids: Sequence[int], spec: SpeculativeConfig, limit: int | None = None) -> list[int]:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (the longest n that occurs), at most
    `min(trusted_drafts(n, spec), limit)`."""
    k = spec.num_tokens if limit is None else min(spec.num_tokens, limit)
    if k <= 0 or len(token_ids) <= spec.min_ngram:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(spec.max_ngram, len(tokens) - 1), spec.min_ngram - 1, -1):
        # windows starting at 0..len-n-1: every occurrence but the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + min(k, trusted_drafts(n, spec))].tolist()
    return []


def trusted_drafts(match: int, spec: SpeculativeConfig) -> int:
    """How many drafts a prompt-lookup match of `match` tokens is worth: all K from a match of
    TRUSTED_MATCH tokens or more, else one per matched token. A draft row costs a fraction of a
    step and saves a whole one only when accepted, and how often it is accepted follows the
    match's length: on the code-edit bench (SmolLM2, always K=8) the first draft was accepted
    34% of the time after a 1-token match, 65% after 2, 90% after 3 or more (the 8th: 14%, 7%
    and 54%)."""
    return spec.num_tokens if match >= TRUSTED_MATCH else min(match, spec.num_tokens)


def next_draft_limit(accepted: int, spec: SpeculativeConfig) -> int:
    """How many drafts a request drafting with a draft model proposes after a step that accepted
    `accepted` of them: one more, at most the configured number. The draft model says nothing of
    how sure it is, so the request's own record stands in: one that is copying drafts up to the
    limit and one that is not drafts one token at a time, which is enough to notice when it
    starts copying again. (Prompt lookup judges each proposal by its match: trusted_drafts.)"""
    return min(spec.num_tokens, accepted + 1)


def pause_after(misses: int) -> int:
    """How many steps a request drafting with a draft model skips drafting after `misses` verify
    steps in a row accepted none of its drafts: none after one, then 1, 3, 7, at most
    MAX_DRAFT_PAUSE; an accepted draft sets misses back to 0. Each drafting step pays a pass of the
    draft model before the target's rows, so drafts that keep missing cost time for nothing.
    Prompt lookup does not pause: its drafts cost only their rows (one or two after a short
    match, by trusted_drafts), and a pause would miss the start of a span the model begins to copy (on
    the code-edit bench it took 109 steps against 96)."""
    return min(MAX_DRAFT_PAUSE, 2 ** (misses - 1) - 1) if misses > 0 else 0


def num_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts the target tokens confirm (`targets` has one more row than drafts)."""
    accepted = 0
    while accepted < len(drafts) and targets[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


class DraftProposer(Protocol):
    """A draft model (`engine/draft_model.py`): each request's next tokens, proposed greedily."""

    def propose(self, wants: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to `limit` drafts for each (request, limit), by request id; a request it cannot
        draft for (its pool is full, or it is still catching up on the prompt) is left out."""
        ...

    def retain(self, live: Container[str]) -> None:
        """Forget every request whose id is not in `live` (finished, aborted, handed off)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget one request (aborted, or preempted)."""
        ...


class Drafter:
    """The engine's drafting: what each request proposes for its next step, and how many drafted
    tokens the target has verified and accepted so far (the worker's metrics)."""

    def __init__(self, spec: SpeculativeConfig | None, max_model_len: int,
                 draft_model: DraftProposer | None = None) -> None:
        if spec is not None and (spec.method == "draft") != (draft_model is not None):
            raise ValueError("a draft model is needed by, and only by, --speculative draft:DIR")
        self.spec = spec
        self.max_model_len = max_model_len
        self.draft_model = draft_model
        self.drafted = 0
        self.accepted = 0

    def verify(self, request: Request, num_drafts: int, rows: Sequence[tuple[int, object]]) -> int:
        """How many of the request's first `num_drafts` drafts the step's sampled rows ((token,
        logprob) each) confirm; counted, and the request's next draft limit set from it."""
        if not num_drafts:
            return 0
        accepted = num_accepted(request.draft_token_ids[:num_drafts], [token for token, _ in rows])
        self.drafted += num_drafts
        self.accepted += accepted
        if self.draft_model is not None and self.spec is not None:
            request.draft_limit = next_draft_limit(accepted, self.spec)
            request.draft_misses = 0 if accepted else request.draft_misses + 1
            request.draft_pause = pause_after(request.draft_misses)
        return accepted

    def release(self, request_id: str) -> None:
        """A request's draft-model state freed now (aborted, or preempted with its KV), not when
        a later step finds it gone."""
        if self.draft_model is not None:
            self.draft_model.release(request_id)

    def propose(self, requests: Sequence[Request], live: Container[str]) -> None:
        """Set each request's drafts for its next step (the draft model's in one batch); `live`
        holds every request id still in the engine, so a draft model drops the others' state."""
        spec = self.spec
        if spec is None:
            return
        wants = [(r, limit) for r in requests if (limit := self._limit(r, spec)) > 0]
        if self.draft_model is None:
            drafts = {r.request_id: propose_ngram(r.token_ids, spec, limit) for r, limit in wants}
        else:
            self.draft_model.retain(live)
            drafts = self.draft_model.propose(wants)
        for request in requests:
            request.draft_token_ids = drafts.get(request.request_id, [])

    def _limit(self, request: Request, spec: SpeculativeConfig) -> int:
        """How many drafts the request may take: none for a structured output (its grammar would
        have to vet them), a prefill-only request or one pausing after misses; never past
        max_tokens or the context length."""
        if request.matcher is not None or request.prefill_only:
            return 0
        if request.draft_pause > 0:
            request.draft_pause -= 1
            return 0
        limit = spec.num_tokens if request.draft_limit is None else request.draft_limit
        # a step emits up to drafts + 1 tokens, and computes positions up to num_tokens - 1 + drafts
        return min(request.params.max_tokens - len(request.output_token_ids) - 1,
                   self.max_model_len - request.num_tokens - 1, limit)
