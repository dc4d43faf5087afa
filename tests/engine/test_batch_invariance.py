"""`--deterministic`: a request's logits are the same bits whatever else shares its steps.

The property is checked where it is made, the forward pass: a sequence's logits at every position
computed alone in one prompt chunk against the same sequence computed in chunks of any size,
decode steps among them (a preempted request's recompute is the reverse), beside other sequences'
chunks and decodes in every step, on blocks anywhere in the pool. Then through the engine: a
seeded request at temperature 1 gives the same tokens and logprobs alone, in a crowd, with its
prefix cached, under a small chunk budget and after being preempted.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.helpers import make_engine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.runner import StepPart, TorchModelRunner
from tokenmill.textgen.sampling import SamplingParams

CHUNKS = (1, 1, 2, 3, 7, 16, 33, 64, 128, 256, 512)
THREADS = 2  # the kernels share a step out between threads by its shape: the split must not show


@pytest.fixture(scope="module", autouse=True)
def split_between_threads() -> Iterator[None]:
    """The suite's processes run one thread each (tests/conftest.py); these tests run several."""
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(previous)


class Pool:
    """Blocks handed out front to back: each sequence its own, anywhere in the pool."""

    def __init__(self, block_size: int, first: int) -> None:
        self.block_size, self.next = block_size, first

    def take(self, tokens: int) -> np.ndarray:
        n = -(-tokens // self.block_size)
        self.next += n
        return np.arange(self.next - n, self.next, dtype=np.int64)


def _logits_by_position(runner: TorchModelRunner, steps: list[list[tuple[str, int, int]]],
                        seqs: dict[str, list[int]], blocks: dict[str, np.ndarray], wanted: str) -> list[torch.Tensor]:
    """Run `steps` (each a list of (sequence, start, end)) and return `wanted`'s logits row per position."""
    found: dict[int, torch.Tensor] = {}
    for step in steps:
        parts = [StepPart(seqs[s][a:b], a, blocks[s], b - a == 1 and a > 0, b - a) for s, a, b in step]
        ids, pos, batch, rows = runner.step_inputs(parts)
        with torch.inference_mode():
            logits = runner.forward(ids, pos, batch, rows)
        row = 0
        for s, a, b in step:
            if s == wanted:
                found.update({p: logits[row + p - a].clone() for p in range(a, b)})
            row += b - a
    return [found[p] for p in range(len(seqs[wanted]))]


def _crowded_schedule(rng: random.Random, length: int, vocab: int, pool: Pool, seqs: dict[str, list[int]],
                      blocks: dict[str, np.ndarray]) -> list[list[tuple[str, int, int]]]:
    """"x" in random chunks (a chunk of 1 after the first is a decode), each step shared with up to
    31 other sequences, each of those a new prompt chunk or the next token of an earlier one."""
    steps, at, live = [], 0, []
    while at < length:
        end = min(length, at + rng.choice(CHUNKS))
        step = [("x", at, end)]
        for _ in range(rng.randint(0, 31)):
            if live and rng.random() < 0.5:  # another sequence's decode
                name = rng.choice(live)
                if len(seqs[name]) < blocks[name].size * pool.block_size:
                    seqs[name].append(rng.randrange(3, vocab))
                    step.append((name, len(seqs[name]) - 1, len(seqs[name])))
                continue
            name = f"o{len(seqs)}"
            seqs[name] = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 48))]
            blocks[name] = pool.take(len(seqs[name]) + 16)  # room for its decodes
            live.append(name)
            step.append((name, 0, len(seqs[name])))
        rng.shuffle(step)
        steps.append(step)
        at = end
    return steps


@pytest.fixture(scope="module", params=[("tiny-dense", "float32"), ("tiny-moe", "float32"),
                                        ("tiny-moe", "bfloat16")], ids=lambda p: f"{p[0]}-{p[1]}")
def invariant_engine(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> LLMEngine:
    preset, dtype = request.param
    return make_engine(model_dirs[preset], dtype=dtype, num_kv_blocks=4096, deterministic=True)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(1, 300), seed=st.integers(0, 2**32))
def test_logits_at_every_position_are_bitwise_the_same_in_any_batch_and_split(
        invariant_engine: LLMEngine, length: int, seed: int) -> None:
    runner = invariant_engine.runner
    assert isinstance(runner, TorchModelRunner)
    rng, vocab, bs = random.Random(seed), invariant_engine.model_config.vocab_size, invariant_engine.config.block_size
    x = [rng.randrange(3, vocab) for _ in range(length)]
    alone = _logits_by_position(runner, [[("x", 0, length)]], {"x": x}, {"x": Pool(bs, 0).take(length)}, "x")
    pool = Pool(bs, rng.randrange(1, 1000))
    seqs, blocks = {"x": x}, {"x": pool.take(length)}
    steps = _crowded_schedule(rng, length, vocab, pool, seqs, blocks)
    crowded = _logits_by_position(runner, steps, seqs, blocks, "x")
    differing = [p for p in range(length) if not torch.equal(alone[p], crowded[p])]
    assert not differing, f"positions {differing[:8]} differ ({len(steps)} steps)"


# ---- through the engine ------------------------------------------------------------------------

SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, logprobs=5, ignore_eos=True)


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
         watch: str = "") -> tuple[dict[str, list[tuple[int, float, list]]], int]:
    """Each request's (token, logprob, top logprobs) in order, and how often `watch` was preempted."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[tuple[int, float, list]]] = {rid: [] for rid in requests}
    preempted = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += [(lp.token_id, lp.logprob, lp.top) for lp in o.new_logprobs]
        if watch in engine.requests:
            preempted = max(preempted, engine.requests[watch].num_preemptions)
    return out, preempted


def _crowd(engine: LLMEngine, count: int, seed: int) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    return {f"other-{seed}-{i}": ([rng.randrange(3, vocab) for _ in range(rng.randint(5, 90))],
                                  SamplingParams(max_tokens=rng.randint(4, 40), temperature=rng.choice([0.0, 0.8]),
                                                 seed=rng.randrange(1000), ignore_eos=True))
            for i in range(count)}


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_a_seeded_request_samples_the_same_tokens_wherever_it_runs(model_dirs: dict[str, Path], preset: str) -> None:
    model = model_dirs[preset]
    prompt = [random.Random(7).randrange(3, 500) for _ in range(100)]
    alone, _ = _run(make_engine(model, deterministic=True, enable_prefix_caching=False), {"r": (prompt, SAMPLED)})
    crowded = make_engine(model, deterministic=True, max_num_batched_tokens=64)
    got, _ = _run(crowded, {**_crowd(crowded, 12, seed=1), "r": (prompt, SAMPLED)})
    assert got["r"] == alone["r"], "beside 12 other requests, 64-token chunks"
    half, _ = _run(crowded, {"half": (prompt[:50] + [9] * 50, SAMPLED)})
    hits = crowded.kv.stats.hit_tokens
    got, _ = _run(crowded, {"r2": (prompt, SAMPLED)})
    assert crowded.kv.stats.hit_tokens - hits >= 96 and got["r2"] == alone["r"], "its whole prompt cached"
    small_chunks = make_engine(model, deterministic=True, max_num_batched_tokens=16)
    small_chunks.generate([prompt[:48] + [5] * 40], SamplingParams(max_tokens=1, temperature=0.0))
    got, _ = _run(small_chunks, {"r": (prompt, SAMPLED)})
    assert got["r"] == alone["r"], "16-token chunks, its first 48 tokens cached"
    tight = make_engine(model, deterministic=True, num_kv_blocks=24)
    got, preempted = _run(tight, {**_crowd(tight, 10, seed=2), "r": (prompt, SAMPLED)}, watch="r")
    assert preempted > 0 and got["r"] == alone["r"], "preempted and recomputed"
    assert half["half"] != alone["r"]  # the check above can fail: another prompt samples other tokens


def test_deterministic_needs_the_native_kernels(tiny_dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.kernels import grouped_experts

    assert EngineConfig(model=str(tiny_dense), device="auto", deterministic=True).device == "cpu"  # no GPU here
    monkeypatch.setattr(grouped_experts, "available", lambda dtype: False)  # as without a C compiler
    with pytest.raises(ValueError, match="--deterministic needs the native CPU kernels"):
        make_engine(tiny_dense, deterministic=True)


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_within_one_parallel_layout_too(tiny_moe: Path, tp: int, ep: int) -> None:
    """Rank processes of a --tp/--ep worker take the same kernels (the flag reaches them): a seeded
    request's logprobs alone and in a crowd, in 64-token chunks and computed again (no prefix
    cache), are the same bits. (Two ranks' partial sums add the same in either order.)"""
    prompt = [random.Random(9).randrange(3, 500) for _ in range(100)]
    engine = make_engine(tiny_moe, tp=tp, ep=ep, deterministic=True, max_num_batched_tokens=64,
                         enable_prefix_caching=False)
    try:
        alone, _ = _run(engine, {"r": (prompt, SAMPLED)})
        crowded, _ = _run(engine, {**_crowd(engine, 10, seed=3), "r2": (prompt, SAMPLED)})
    finally:
        engine.close()
    assert crowded["r2"] == alone["r"]
