"""Token-id prompts for `tokenmill bench serve`: exact lengths, valid ids, optional shared prefixes.

Prompts are lists of token ids (the server accepts them in `prompt`), so a prompt's length
is exactly what was asked for and no tokenizer round trip can change it. Ids are drawn
from `TokenSpace` = [min_id, vocab_size): the tiny presets' special tokens are ids 0..2,
so the default `min_id=3` never sends a control token.

Trace prompts come from `HashBlockSynth`: each Mooncake hash id maps, deterministically
for a seed, to its own block of tokens, so two requests that share hash ids share the
same token blocks, and the server's prefix cache sees the same reuse the trace records.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Mooncake traces hash the prompt in blocks of 512 tokens.
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(slots=True, frozen=True)
class TokenSpace:
    """Token ids a prompt may use: [min_id, vocab_size)."""
    vocab_size: int = 2048
    min_id: int = 3

    def __post_init__(self) -> None:
        if self.min_id < 0:
            raise ValueError(f"--min-token-id must be >= 0, got {self.min_id}")
        if self.vocab_size <= self.min_id:
            raise ValueError(f"--vocab-size ({self.vocab_size}) must exceed --min-token-id ({self.min_id})")


@dataclass(slots=True)
class RequestSpec:
    """One request to send: its prompt, the exact output length, and when it arrives.

    `arrival_s` is the offset from the start of the run (None: closed loop, sent as soon
    as a concurrency slot frees). `hash_ids` are the trace's block hashes, if any.
    """
    prompt: list[int]
    output_len: int
    arrival_s: float | None = None
    hash_ids: tuple[int, ...] = ()


@dataclass(slots=True, frozen=True)
class SyntheticShape:
    """Lengths of synthetic requests; each drawn uniformly from its inclusive range.

    The prompt is a shared prefix of `prefix_len` tokens (one of `num_prefix_groups`,
    request i uses group i mod groups) followed by `input_len` random tokens.
    """
    min_input: int
    max_input: int
    min_output: int
    max_output: int
    prefix_len: int = 0
    num_prefix_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("min_input", "min_output", "num_prefix_groups"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.prefix_len < 0:
            raise ValueError(f"--prefix-len must be >= 0, got {self.prefix_len}")
        for low, high in (("min_input", "max_input"), ("min_output", "max_output")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"--{high.replace('_', '-')} ({getattr(self, high)}) is below "
                                 f"--{low.replace('_', '-')} ({getattr(self, low)})")


def random_tokens(rng: np.random.Generator, space: TokenSpace, count: int) -> list[int]:
    return rng.integers(space.min_id, space.vocab_size, size=count).tolist()


def synthetic_requests(num_requests: int, shape: SyntheticShape, space: TokenSpace, seed: int) -> list[RequestSpec]:
    """Seeded synthetic requests: the same arguments always give the same prompts."""
    rng = random.Random(seed)
    token_rng = np.random.default_rng(seed)
    prefixes = [random_tokens(token_rng, space, shape.prefix_len) for _ in range(shape.num_prefix_groups)]
    specs = []
    for i in range(num_requests):
        input_len = rng.randint(shape.min_input, shape.max_input)
        output_len = rng.randint(shape.min_output, shape.max_output)
        prompt = prefixes[i % shape.num_prefix_groups] + random_tokens(token_rng, space, input_len)
        specs.append(RequestSpec(prompt, output_len))
    return specs


def corpus_requests(corpus: Sequence[int], num_requests: int, shape: SyntheticShape, seed: int) -> list[RequestSpec]:
    """Seeded slices of a tokenized text (real prose, so attention sees what it would in service),
    each from its own start token: no two prompts share a first block, so none hits the prefix
    cache. `shape.prefix_len` is not used. ValueError naming --max-input when the text is too short."""
    room = len(corpus) - shape.max_input
    if room < num_requests:
        raise ValueError(f"--max-input {shape.max_input}: the corpus ({len(corpus)} tokens) has no room "
                         f"for {num_requests} distinct prompts that long")
    rng = random.Random(seed)
    specs = []
    for start in rng.sample(range(room), num_requests):
        input_len = rng.randint(shape.min_input, shape.max_input)
        output_len = rng.randint(shape.min_output, shape.max_output)
        specs.append(RequestSpec(list(corpus[start:start + input_len]), output_len))
    return specs


def poisson_arrivals(specs: Sequence[RequestSpec], rate_per_s: float, seed: int) -> None:
    """Give each request an arrival offset: a Poisson process of `rate_per_s`, first at t=0."""
    if rate_per_s <= 0:
        raise ValueError(f"--request-rate must be positive, got {rate_per_s}")
    rng = random.Random(seed ^ 0x5EED)  # not the length stream: lengths stay the same at any rate
    now = 0.0
    for spec in specs:
        spec.arrival_s = now
        now += rng.expovariate(rate_per_s)


@dataclass(slots=True)
class HashBlockSynth:
    """Maps a trace hash id to its token block; equal ids always give equal blocks."""
    space: TokenSpace
    tokens_per_block: int
    seed: int = 0
    _blocks: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0:
            raise ValueError(f"--tokens-per-hash-block must be positive, got {self.tokens_per_block}")

    def block(self, hash_id: int) -> list[int]:
        cached = self._blocks.get(hash_id)
        if cached is None:
            # seeded by (seed, hash id) alone, so a block never depends on which request asks first
            rng = np.random.default_rng([self.seed, 0, hash_id])
            cached = self._blocks[hash_id] = random_tokens(rng, self.space, self.tokens_per_block)
        return cached

    def scaled_length(self, mooncake_input_length: int) -> int:
        """The trace's input length in our block size: len · tokens_per_block / 512, at least 1."""
        return max(1, round(mooncake_input_length * self.tokens_per_block / MOONCAKE_BLOCK_TOKENS))

    def prompt(self, hash_ids: Sequence[int], length: int, request_index: int) -> list[int]:
        """The hash blocks concatenated, cut to `length`; padded with request-unique tokens if short."""
        tokens: list[int] = []
        for hash_id in hash_ids:
            if len(tokens) >= length:
                break
            tokens.extend(self.block(hash_id))
        if len(tokens) < length:
            # padding seeded by the request, so it never creates sharing the trace does not have
            rng = np.random.default_rng([self.seed, 1, request_index])
            tokens.extend(random_tokens(rng, self.space, length - len(tokens)))
        return tokens[:length]
