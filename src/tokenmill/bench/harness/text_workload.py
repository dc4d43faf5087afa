"""A shared-prefix load sent as text: groups of requests that each open with their group's
passage of the package's English corpus (the Austen novel the test tokenizers are trained on),
then a short unique question. The prefix-routing and engines benchmarks send it.

`build_workload(words, prefix_words, tokenizer, args)` reads `args.seed`, `args.groups`,
`args.requests`, `args.max_tokens` and `args.pool_fraction` (of all the prefixes' blocks, the
KV pool each worker is given, so only routing that keeps a group on a worker realises its hits).
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from importlib import resources
from typing import Any

from tokenmill.bench.harness import loadgen
from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE
from tokenmill.workloads.prompt_synth import RequestSpec


@dataclass(slots=True)
class TextSpec(RequestSpec):
    """A request sent as text; `prompt` holds the client's tokenization, for lengths only."""
    text: str = ""


class TextTarget(loadgen.Target):
    __slots__ = ()

    def completion_body(self, spec: RequestSpec) -> dict[str, Any]:
        body = loadgen.Target.completion_body(self, spec)  # not super(): slots dataclasses break it
        body["prompt"] = spec.text if isinstance(spec, TextSpec) else spec.prompt
        return body


@dataclass(slots=True)
class Workload:
    prefix_words: int
    prefix_tokens: list[int]  # per group
    kv_cache_blocks: int
    specs: list[TextSpec]


def corpus_words() -> list[str]:
    return resources.files("tokenmill.textgen.corpus").joinpath("persuasion.txt").read_text(encoding="utf-8").split()


def build_workload(words: list[str], prefix_words: int, tokenizer: Any, args: argparse.Namespace) -> Workload:
    """Seeded: both policies (and every repeat) see the same prompts in the same order."""
    if prefix_words >= len(words):
        raise ValueError(f"--prefix-words {prefix_words}: the corpus has only {len(words)} words")
    rng = random.Random(args.seed * 1_000_003 + prefix_words)
    # distinct starting words: passages may overlap further in, but block hashes chain from the start
    starts = rng.sample(range(len(words) - prefix_words), args.groups)
    prefixes = [" ".join(words[s:s + prefix_words]) for s in starts]
    order = [i % args.groups for i in range(args.requests)]
    rng.shuffle(order)
    specs = []
    for i, group in enumerate(order):
        # a space then a word starts a new pre-token, so the prefix tokenizes the same inside the prompt
        text = f"{prefixes[group]} Question {i}: {' '.join(rng.choices(words, k=6))}?"
        specs.append(TextSpec(tokenizer.encode(text), args.max_tokens, text=text))
    tokens = [len(tokenizer.encode(p)) for p in prefixes]
    blocks = round(args.pool_fraction * sum(-(-t // DEFAULT_BLOCK_SIZE) for t in tokens))
    return Workload(prefix_words, tokens, blocks, specs)
