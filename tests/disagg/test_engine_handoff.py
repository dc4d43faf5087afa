"""The engine side of disaggregation: hold after prefill, import before decode.

Two real engines on the same checkpoint; the test copies blocks between their pools the way a
transfer would, and checks the decode engine continues exactly where one engine would have.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.engine.helpers import GREEDY, make_engine, prompts
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.textgen.outputs import FINISH_HANDOFF, RequestOutput
from tokenmill.textgen.sampling import SamplingParams

PARAMS = dataclasses.replace(GREEDY, max_tokens=24)


def prefill(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams = PARAMS) -> RequestOutput:
    engine.add_request(request_id, prompt, params, prefill_only=True)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == request_id]
    assert len(outs) == 1 and outs[0].finished
    return outs[0]


def decode(engine: LLMEngine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == request_id for t in o.new_token_ids]
    return tokens


def copy_blocks(src: LLMEngine, src_ids: list[int], dst: LLMEngine, dst_ids: list[int]) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        dst.runner.kv_cache[:, :, d] = src.runner.kv_cache[:, :, s]


def continue_params() -> SamplingParams:
    return dataclasses.replace(PARAMS, max_tokens=PARAMS.max_tokens - 1)


@pytest.fixture(scope="module")
def engines(tiny_dense: Path) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    return tuple(make_engine(tiny_dense, num_kv_blocks=96) for _ in range(3))  # type: ignore[return-value]


def test_imported_kv_continues_exactly(engines: tuple[LLMEngine, LLMEngine, LLMEngine]) -> None:
    ref, pre, dec = engines
    for i, prompt in enumerate(prompts(ref, 6, seed=3, low=5, high=150)):
        expected = ref.generate([prompt], PARAMS)[0]
        first = prefill(pre, f"r{i}", prompt)
        assert first.finish_reason == FINISH_HANDOFF and first.new_token_ids == expected[:1]
        assert len(first.held_block_ids) == -(-len(prompt) // pre.config.block_size)
        computed_before = dec.stats().prefill_tokens
        plan = dec.begin_import(f"r{i}", prompt + first.new_token_ids, continue_params(), output_offset=1)
        assert plan is not None and plan.num_tokens == len(prompt)
        copy_blocks(pre, first.held_block_ids[plan.first_block:], dec, plan.block_ids)
        assert dec.finish_import(f"r{i}", ok=True)
        assert first.new_token_ids + decode(dec, f"r{i}") == expected
        assert dec.stats().prefill_tokens == computed_before  # the decode engine only decoded
        assert pre.release_held(f"r{i}") and not pre.release_held(f"r{i}")
    for engine in engines:
        assert engine.stats().num_held == engine.stats().num_importing == 0
        assert engine.pool.num_free_blocks == engine.pool.num_blocks  # nothing leaked


def test_failed_import_is_recomputed_never_decoded(engines: tuple[LLMEngine, LLMEngine, LLMEngine]) -> None:
    ref, pre, dec = engines
    prompt = prompts(ref, 1, seed=11, low=60, high=61)[0]
    expected = ref.generate([prompt], PARAMS)[0]
    first = prefill(pre, "bad", prompt)
    plan = dec.begin_import("bad", prompt + first.new_token_ids, continue_params(), output_offset=1)
    assert plan is not None
    dec.runner.kv_cache[:, :, plan.block_ids] = 7.0  # what a torn transfer leaves behind
    computed_before = dec.stats().prefill_tokens
    assert dec.finish_import("bad", ok=False)
    assert first.new_token_ids + decode(dec, "bad") == expected
    assert dec.stats().prefill_tokens - computed_before >= len(prompt)  # the prompt was recomputed
    pre.release_held("bad")
    assert dec.pool.num_free_blocks == dec.pool.num_blocks


def test_local_prefix_hit_is_not_pulled(engines: tuple[LLMEngine, LLMEngine, LLMEngine]) -> None:
    ref, pre, dec = engines
    shared = prompts(ref, 1, seed=5, low=64, high=65)[0]
    dec.generate([shared + [7, 8, 9]], dataclasses.replace(PARAMS, max_tokens=2))  # dec caches 4 blocks
    prompt = shared + prompts(ref, 1, seed=6, low=40, high=41)[0]
    expected = ref.generate([prompt], PARAMS)[0]
    first = prefill(pre, "hit", prompt)
    plan = dec.begin_import("hit", prompt + first.new_token_ids, continue_params(), output_offset=1)
    assert plan is not None and plan.first_block == 64 // dec.config.block_size
    copy_blocks(pre, first.held_block_ids[plan.first_block:], dec, plan.block_ids)
    dec.finish_import("hit", ok=True)
    assert first.new_token_ids + decode(dec, "hit") == expected
    pre.release_held("hit")


def test_full_pool_falls_back_to_local_prefill(tiny_dense: Path) -> None:
    pre, dec = make_engine(tiny_dense, num_kv_blocks=64), make_engine(tiny_dense, num_kv_blocks=8)
    prompt = prompts(pre, 1, seed=2, low=100, high=101)[0]
    first = prefill(pre, "big", prompt)
    dec.add_request("hog", prompts(dec, 1, seed=9, low=100, high=101)[0], PARAMS)
    dec.step()  # the hog holds 7 of the 8 blocks while it prefills
    plan = dec.begin_import("big", prompt + first.new_token_ids, dataclasses.replace(PARAMS, max_tokens=2),
                            output_offset=1)
    assert plan is None and dec.stats().num_importing == 0  # queued for a local prefill instead
    while dec.has_unfinished():
        dec.step()
    assert dec.pool.num_free_blocks == dec.pool.num_blocks


def test_abort_frees_held_and_importing_blocks(engines: tuple[LLMEngine, LLMEngine, LLMEngine]) -> None:
    _, pre, dec = engines
    prompt = prompts(pre, 1, seed=8, low=50, high=51)[0]
    first = prefill(pre, "gone", prompt)
    assert pre.stats().num_held == 1 and pre.abort("gone")
    plan = dec.begin_import("gone", prompt + first.new_token_ids, continue_params(), output_offset=1)
    assert plan is not None and dec.abort("gone") and not dec.finish_import("gone", ok=True)
    for engine in (pre, dec):
        assert engine.stats().num_held == engine.stats().num_importing == 0
        assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_first_token_that_ends_the_request_holds_nothing(engines: tuple[LLMEngine, LLMEngine, LLMEngine]) -> None:
    _, pre, _ = engines
    out = prefill(pre, "one", prompts(pre, 1, seed=4)[0], dataclasses.replace(PARAMS, max_tokens=1))
    assert out.finish_reason == "length" and out.held_block_ids == [] and pre.stats().num_held == 0


def test_import_needs_the_sampled_token(engines: tuple[LLMEngine, LLMEngine, LLMEngine]) -> None:
    _, _, dec = engines
    with pytest.raises(ValueError, match="output_offset|continues"):
        dec.begin_import("x", [5, 6, 7], PARAMS, output_offset=0)


def test_text_held_back_for_stop_strings_reaches_the_client(tiny_dense: Path) -> None:
    """With a stop string set, the first token's text may be held back; the decode side must
    emit it, and a stop string spanning the handoff must still end the request."""
    ref, pre, dec = (make_engine(tiny_dense, num_kv_blocks=96) for _ in range(3))
    prompt = prompts(ref, 1, seed=13, low=30, high=31)[0]
    plain = dataclasses.replace(PARAMS, stop=["\x00never\x00"])
    full = "".join(o.new_text for o in run_all(ref, "ref", prompt, plain))
    first_len = len(ref.tokenizer.decode(ref.generate([prompt], PARAMS)[0][:1]))
    assert 0 < first_len < len(full) - 2
    spanning = full[first_len - 1:first_len + 2]  # starts in the first token's text, ends after it
    for params in (plain, dataclasses.replace(PARAMS, stop=[spanning])):
        expected = "".join(o.new_text for o in run_all(ref, "ref", prompt, params))
        first = prefill(pre, "s", prompt, params)
        assert first.finish_reason == FINISH_HANDOFF and first.new_text == "" and first.text_pending_tokens == 1
        plan = dec.begin_import("s", prompt + first.new_token_ids,
                                dataclasses.replace(params, max_tokens=params.max_tokens - 1), output_offset=1,
                                text_pending=first.text_pending_tokens)
        assert plan is not None
        copy_blocks(pre, first.held_block_ids[plan.first_block:], dec, plan.block_ids)
        dec.finish_import("s", ok=True)
        text = first.new_text + "".join(o.new_text for o in run_all(dec, "s"))
        assert text == expected
        pre.release_held("s")


def run_all(engine: LLMEngine, request_id: str, prompt: list[int] | None = None,
            params: SamplingParams | None = None) -> list[RequestOutput]:
    if prompt is not None and params is not None:
        engine.add_request(request_id, prompt, params)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs
