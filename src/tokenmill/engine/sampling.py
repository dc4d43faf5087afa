"""Sampling parameters (validated on construction) and the batched sampler.

Randomness is stateless per token: a request with a seed draws token k from a
generator seeded by (seed, k), so the same seed gives the same tokens whatever
the batch, and a preempted or migrated request continues the same stream.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N: the sampled token's logprob plus the top N

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63))
        if not isinstance(self.stop_token_ids, (list, tuple)) or \
                not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_TOP_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if any(s == "" for s in stop):
        raise ValueError("stop strings must not be empty")
    return list(stop)


def _check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _check_number(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    output_index: int  # how many tokens the request has produced before this one


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], generator: torch.Generator) -> tuple[
        list[int], list[TokenLogprob | None]]:
    """One token per row of fp32 `logits` [rows, vocab]."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows)
        tokens[idx] = _sample_random(logits.index_select(0, idx), [rows[i] for i in random_rows], generator)
    token_list = tokens.tolist()
    return token_list, _logprobs(logits, rows, token_list)


def _sample_random(logits: torch.Tensor, rows: Sequence[SampleRow], generator: torch.Generator) -> torch.Tensor:
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temps
    top_ks = [r.params.top_k for r in rows]
    top_ps = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = _mask_top_k_top_p(logits, top_ks, top_ps)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.stack([_exponential(logits.shape[1], r, generator) for r in rows])
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race).
    return (probs / noise).argmax(dim=-1)


def _exponential(vocab: int, row: SampleRow, generator: torch.Generator) -> torch.Tensor:
    gen = generator
    if row.params.seed is not None:
        gen = torch.Generator().manual_seed((row.params.seed * 1_000_003 + row.output_index) % (2**63))
    return torch.empty(vocab).exponential_(generator=gen)


def _mask_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks]).clamp(max=vocab)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= ks.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
    drop |= before >= torch.tensor(top_ps).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprobs(logits: torch.Tensor, rows: Sequence[SampleRow], tokens: list[int]) -> list[TokenLogprob | None]:
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return out
    logp = torch.log_softmax(logits.index_select(0, torch.tensor(wanted)), dim=-1)
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs or 0
        top_v, top_i = logp[j].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        out[i] = TokenLogprob(tokens[i], float(logp[j, tokens[i]]),
                              list(zip(top_i.tolist(), top_v.tolist())))
    return out
