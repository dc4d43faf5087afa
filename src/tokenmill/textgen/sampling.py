"""Sampling parameters (validated on construction) and what a sampled token carries.

Torch-free, so the frontend and mock workers never import torch; the batched sampler
itself is `engine/sampler.py`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
    presence_penalty: float = 0.0  # OpenAI: minus this from the logit of every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often the token was generated
    repetition_penalty: float = 1.0  # vLLM/HF: seen tokens' (prompt or output) logits divided (>0) or multiplied
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    grammar: str | None = None  # llguidance grammar the output must match (structured outputs, forced tools)
    # lower is more urgent: the engine admits, schedules and preempts by it (a tenant's class)
    priority: int = 0

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
        _check_int("priority", self.priority, low=-(2**31), high=2**31 - 1)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63))
        if not isinstance(self.stop_token_ids, (list, tuple)) or \
                not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_TOP_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("grammar must be a non-empty string")

    @property
    def penalised(self) -> bool:
        """Whether the sampler must adjust this request's logits before choosing."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

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


def _normalise_logit_bias(bias: object) -> dict[int, float]:
    """Token id (an int, or its decimal string as JSON keys are) -> bias in [-100, 100]."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be a map of token ids to biases")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key)
        if token is None or token < 0:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        _check_number("logit_bias", value)
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token}")
        out[token] = float(value)
    return out


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
    output_token_ids: Sequence[int] = ()  # what it generated so far (presence/frequency penalties)
    prompt_token_ids: Sequence[int] = ()  # its prompt (repetition penalty: seen tokens)
