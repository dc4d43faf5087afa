"""Speculative decoding (prompt-lookup or draft-model drafts, verified in one forward pass) never
changes what a request generates: greedy and seeded outputs are identical with and without it, the
token distribution at temperature 1 is the target's, and the blocks of rejected drafts go back."""
from __future__ import annotations

import dataclasses
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from tests.disagg.test_engine_handoff import copy_blocks, decode, prefill
from tests.engine.helpers import GREEDY, make_engine, prompt_logits, prompts
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.draft_model import DraftModel
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.make_model import write_model
from tokenmill.engine.speculative import (
    SpeculativeConfig,
    check_draft_model,
    next_draft_limit,
    num_accepted,
    pause_after,
    propose_ngram,
    trusted_drafts,
)
from tokenmill.textgen.sampling import SamplingParams

NGRAM = SpeculativeConfig("ngram", 4)


def _repetitive(engine: LLMEngine, count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat their own opening, so a small model's continuation often copies."""
    return [p + p[:24] + p for p in prompts(engine, count, seed=seed, low=20, high=60)]


def _assert_idle(engine: LLMEngine) -> None:
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert engine.kv.num_live_requests() == 0 and not engine.requests
    draft = engine.drafter.draft_model
    if draft is not None:  # a draft model's pool: every request's blocks back
        assert draft.num_free_blocks == draft.num_blocks and not draft.states


def _draft(model: Path, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig.parse(f"draft:{model}", k)


def _drafted(engine: LLMEngine) -> tuple[int, int]:
    stats = engine.stats()
    return stats.spec_draft_tokens, stats.spec_accepted_tokens


# -- the proposer and the acceptance rule ------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    spec = SpeculativeConfig("ngram", 3)
    # the suffix (7, 8) last occurred at index 4, followed by 9, 1, 2: two drafts from a 2-token match
    assert propose_ngram([7, 8, 5, 6, 7, 8, 9, 1, 2, 3, 7, 8], spec) == [9, 1]
    # a longer match wins over a later shorter one: (5, 6, 7) occurs once, followed by 1, 4, 7, 2
    assert propose_ngram([5, 6, 7, 1, 4, 7, 2, 5, 6, 7], spec) == [1, 4, 7]
    assert propose_ngram([5, 6, 7, 1, 4, 7, 2, 5, 6, 7], SpeculativeConfig("ngram", 4)) == [1, 4, 7, 2]
    assert propose_ngram([1, 2, 3, 4], spec) == []  # nothing repeats
    assert propose_ngram([1, 2, 1, 2], spec, limit=1) == [1]
    assert propose_ngram([1, 2, 1, 2], spec, limit=0) == []
    assert propose_ngram([4, 4], spec) == [4]  # the match may run into the suffix itself
    # matches of up to 5 tokens are told apart: (2, 9, 1, 2, 3) occurred at 6, (1, 2, 3) later at 12
    tokens = [1, 2, 3, 8, 8, 8, 2, 9, 1, 2, 3, 5, 1, 2, 3, 6, 6, 2, 9, 1, 2, 3]
    assert propose_ngram(tokens, spec) == [5, 1, 2]
    assert propose_ngram(tokens, SpeculativeConfig("ngram", 3, max_ngram=3)) == [6, 6, 2]


def test_a_match_is_trusted_for_as_many_drafts_as_it_is_long_up_to_all_k() -> None:
    spec = SpeculativeConfig("ngram", 4)
    assert [trusted_drafts(n, spec) for n in range(1, 7)] == [1, 2, 4, 4, 4, 4]
    assert [trusted_drafts(n, SpeculativeConfig("ngram", 1)) for n in (1, 2, 3)] == [1, 1, 1]


def test_acceptance_counts_the_confirmed_leading_drafts() -> None:
    assert num_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert num_accepted([5, 6, 7], [4, 6, 7, 8]) == 0
    assert num_accepted([], [4]) == 0


def test_a_draft_model_request_drafts_one_more_than_it_last_had_accepted() -> None:
    spec = SpeculativeConfig("draft", 4, draft_model="unused")
    assert next_draft_limit(0, spec) == 1  # not copying: one draft a step
    assert next_draft_limit(1, spec) == 2  # copying again: it grows
    assert next_draft_limit(4, spec) == 4  # never past the configured K
    # drafts that keep missing pause: none after one miss, then 1, 3, 7 steps, at most 15
    assert [pause_after(m) for m in range(7)] == [0, 0, 1, 3, 7, 15, 15]


@pytest.mark.parametrize(("method", "k", "message"), [
    ("medusa", None, "--speculative must be one of ngram"),
    ("draft:/nonexistent/x", None, "'/nonexistent/x' is not a model directory (no config.json)"),
    ("draft:", None, "'' is not a model directory"),
    ("ngram", 0, "--num-speculative-tokens must be in [1, 16]"),
    ("ngram", 17, "--num-speculative-tokens must be in [1, 16]"),
    (None, 3, "--num-speculative-tokens needs --speculative (ngram or draft:DIR)"),
])
def test_bad_flags_name_themselves(method: str | None, k: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SpeculativeConfig.parse(method, k)


def test_a_draft_model_must_share_the_tokenizer(tiny_dense: Path, tmp_path: Path) -> None:
    check_draft_model(str(tiny_dense), str(tiny_dense))
    config = json.loads((tiny_dense / "config.json").read_text())
    wider = tmp_path / "wider"
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    with pytest.raises(ValueError, match="draft's vocabulary has 2056 tokens, the model's 2048"):
        check_draft_model(str(tiny_dense), str(wider))
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(tiny_dense / "config.json", renamed)
    tokenizer = json.loads((tiny_dense / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (renamed / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="maps tokens to other ids"):
        EngineConfig(model=str(tiny_dense), speculative=_draft(renamed))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(ValueError, match="^--speculative draft:DIR: "):
        check_draft_model(str(tiny_dense), str(unknown))


def test_serve_exits_2_naming_the_flag(tiny_dense: Path) -> None:
    for flags, message in ((["--speculative", "medusa"], "--speculative must be one of ngram"),
                           (["--speculative", "draft:nowhere"], "--speculative draft:DIR: 'nowhere' is not"),
                           (["--speculative", "ngram", "--runner", "mock"], "--speculative needs --runner torch")):
        done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(tiny_dense),
                               "--port", "0", *flags], capture_output=True, text=True, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr


def test_the_mock_runner_refuses_it(tiny_dense: Path) -> None:
    with pytest.raises(ValueError, match="--speculative needs --runner torch"):
        EngineConfig(model=str(tiny_dense), runner="mock", speculative=NGRAM)


# -- the engine --------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny_dense", "tiny_moe"])
def test_greedy_output_is_identical_and_fewer_steps_run(preset: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(preset)
    plain, spec = make_engine(model), make_engine(model, speculative=NGRAM)
    batch = _repetitive(plain, 8, seed=3)
    assert spec.generate(batch, GREEDY) == plain.generate(batch, GREEDY)
    drafted, accepted = _drafted(spec)
    assert 0 < accepted < drafted
    assert spec.stats().num_steps < plain.stats().num_steps
    _assert_idle(spec)


def test_seeded_and_penalised_sampling_give_the_same_tokens(tiny_dense: Path) -> None:
    plain, spec = make_engine(tiny_dense), make_engine(tiny_dense, speculative=NGRAM)
    batch = _repetitive(plain, 6, seed=5)
    for params in (SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True,
                                  frequency_penalty=0.5, repetition_penalty=1.3, logprobs=2)):
        assert spec.generate(batch, params) == plain.generate(batch, params)
    assert _drafted(spec)[1] > 0
    _assert_idle(spec)


def test_logprobs_and_stops_land_on_the_same_token(tiny_dense: Path) -> None:
    """A draft run cut by a stop token or max_tokens ends where decoding alone would have."""
    plain, spec = make_engine(tiny_dense), make_engine(tiny_dense, speculative=NGRAM)
    prompt = _repetitive(plain, 1, seed=9)[0]
    whole = plain.generate([prompt], GREEDY)[0]
    stop = whole[17]
    for params in (SamplingParams(max_tokens=64, temperature=0.0, stop_token_ids=[stop], logprobs=1),
                   SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, logprobs=1)):
        outs = [_run(engine, prompt, params) for engine in (plain, spec)]
        assert outs[0] == outs[1]
    _assert_idle(spec)


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple:
    engine.add_request("r", prompt, params)
    tokens, logprobs, last = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [(lp.token_id, round(lp.logprob, 4)) for lp in out.new_logprobs]
            last = out
    return tokens, logprobs, last.finish_reason, last.stop_reason, last.num_output_tokens


def test_prefix_cache_chunked_prefill_and_preemption(tiny_moe: Path) -> None:
    plain = make_engine(tiny_moe)
    batch = _repetitive(plain, 10, seed=6)
    expected = plain.generate(batch, GREEDY)
    warm = make_engine(tiny_moe, speculative=NGRAM)
    assert warm.generate(batch, GREEDY) == expected
    hits = warm.kv.stats.hit_tokens
    assert warm.generate(batch, GREEDY) == expected  # every prompt now from the prefix cache
    assert warm.kv.stats.hit_tokens > hits
    chunked = make_engine(tiny_moe, speculative=NGRAM, max_num_batched_tokens=24)  # drafts share the budget
    assert chunked.generate(batch, GREEDY) == expected
    tight = make_engine(tiny_moe, speculative=NGRAM, num_kv_blocks=30)
    assert tight.generate(batch, GREEDY) == expected
    assert tight.stats().num_preemptions > 0 and _drafted(tight)[1] > 0
    drafted = make_engine(tiny_moe, speculative=_draft(tiny_moe), num_kv_blocks=30)  # a MoE draft model
    assert drafted.generate(batch, GREEDY) == expected
    assert drafted.stats().num_preemptions > 0 and 0 < _drafted(drafted)[1] == _drafted(drafted)[0]
    for engine in (warm, chunked, tight, drafted):
        _assert_idle(engine)


def test_a_draft_model_changes_no_output(tiny_dense: Path, tmp_path: Path) -> None:
    """The target itself as its draft (greedy drafts all accepted, sampled ones in part) and a
    model of other weights (hardly any accepted) leave greedy, seeded and penalised outputs as
    they were, also when the draft's catch-up on a prompt is chunked and under preemption."""
    plain = make_engine(tiny_dense)
    batch = _repetitive(plain, 8, seed=3)
    expected = plain.generate(batch, GREEDY)
    itself = make_engine(tiny_dense, speculative=_draft(tiny_dense))
    assert itself.generate(batch, GREEDY) == expected
    drafted, accepted = _drafted(itself)
    assert drafted == accepted > 0 and itself.stats().num_steps * 2 < plain.stats().num_steps
    sampled = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True,
                             frequency_penalty=0.5, logprobs=2)
    assert itself.generate(batch, sampled) == plain.generate(batch, sampled)
    assert 0 < _drafted(itself)[1] - accepted < _drafted(itself)[0] - drafted
    other = write_model("tiny-dense", tmp_path / "other", seed=1)
    engines = [itself, make_engine(tiny_dense, speculative=_draft(other)),
               make_engine(tiny_dense, speculative=_draft(tiny_dense), max_num_batched_tokens=16),
               make_engine(tiny_dense, speculative=_draft(tiny_dense), num_kv_blocks=30)]
    for engine in engines[1:3]:
        assert engine.generate(batch, GREEDY) == expected
    assert _generate_watching_preemptions(engines[3], batch) == expected
    # the other weights' drafts keep missing, and the requests pause drafting
    assert _drafted(engines[1])[0] < sum(map(len, expected)) // 4
    assert engines[3].stats().num_preemptions > 0
    for engine in engines:
        _assert_idle(engine)


def _generate_watching_preemptions(engine: LLMEngine, batch: list[list[int]]) -> list[list[int]]:
    """`generate`, checking after each step that a waiting request (new, or preempted: its
    target KV freed) holds no draft-model blocks either."""
    step = engine.step

    def checked_step() -> list:
        outputs = step()
        assert not {r.request_id for r in engine.scheduler.waiting} & set(engine.drafter.draft_model.states)
        return outputs

    engine.step = checked_step  # type: ignore[method-assign]
    return engine.generate(batch, GREEDY)


def test_a_draft_pool_that_cannot_hold_a_request_drafts_nothing_for_it_and_an_abort_frees_at_once(tiny_dense: Path) -> None:
    engine = make_engine(tiny_dense)
    draft = DraftModel.load(str(tiny_dense), torch.float32, 4, 16, 256, 256)
    short, long = _repetitive(engine, 2, seed=8)
    engine.add_request("short", short[:40], GREEDY)
    engine.add_request("long", long + long, GREEDY)
    requests = [engine.requests["short"], engine.requests["long"]]
    drafts = draft.propose([(r, 4) for r in requests])
    assert list(drafts) == ["short"] and len(drafts["short"]) == 4  # 40 + 3 fed tokens: 3 blocks of 16
    assert draft.num_free_blocks == 1
    draft.retain({"long"})
    assert draft.num_free_blocks == 4 and list(draft.states) == ["long"]
    shorter = DraftModel.load(str(tiny_dense), torch.float32, 16, 16, 42, 256)  # its context: 42 positions
    assert shorter.propose([(requests[0], 2)])["short"] and not shorter.propose([(requests[0], 4)])
    assert not shorter.states and shorter.num_free_blocks == 16  # past its context: its blocks back

    spec = make_engine(tiny_dense, speculative=_draft(tiny_dense))
    spec.add_request("a", short, GREEDY)
    for _ in range(3):
        spec.step()
    assert spec.drafter.draft_model.states["a"].blocks
    assert spec.abort("a")  # its draft blocks back at once, not at a next step
    _assert_idle(spec)


def test_rejected_drafts_give_their_blocks_back(tiny_dense: Path) -> None:
    """Between steps a request holds blocks for its computed tokens and at most its newest one,
    never for the drafts it verified and lost (up to 16 tokens, 4 blocks here)."""
    spec = make_engine(tiny_dense, speculative=SpeculativeConfig("ngram", 16), block_size=4)
    prompt = _repetitive(spec, 1, seed=12)[0]
    spec.add_request("r", prompt, dataclasses.replace(GREEDY, max_tokens=48))
    while spec.has_unfinished():
        spec.step()
        request = spec.requests.get("r")
        if request is not None:
            assert -(-(request.num_tokens - 1) // 4) <= len(spec.kv.block_ids("r")) <= -(-request.num_tokens // 4)
    drafted, accepted = _drafted(spec)
    assert drafted > accepted > 0
    _assert_idle(spec)


@pytest.mark.parametrize("drafts", ["ngram", "draft"])
def test_a_migrated_continuation_and_an_imported_one_decode_the_same(tiny_dense: Path, drafts: str) -> None:
    plain = make_engine(tiny_dense)
    prompt = _repetitive(plain, 1, seed=14)[0]
    params = dataclasses.replace(GREEDY, max_tokens=40)
    whole = plain.generate([prompt], params)[0]
    spec = NGRAM if drafts == "ngram" else _draft(tiny_dense)
    moved = make_engine(tiny_dense, speculative=spec)
    moved.add_request("m", prompt + whole[:15], dataclasses.replace(params, max_tokens=25), output_offset=15)
    assert decode(moved, "m") == whole[15:]
    pre, dec = make_engine(tiny_dense, num_kv_blocks=96), make_engine(tiny_dense, speculative=spec)
    first = prefill(pre, "d", prompt, params)
    plan = dec.begin_import("d", prompt + first.new_token_ids, dataclasses.replace(params, max_tokens=39),
                            output_offset=1)
    assert plan is not None
    copy_blocks(pre, first.held_block_ids[plan.first_block:], dec, plan.block_ids)
    assert dec.finish_import("d", ok=True)
    assert first.new_token_ids + decode(dec, "d") == whole
    assert _drafted(moved)[1] > 0 and _drafted(dec)[1] > 0
    assert pre.release_held("d")
    for engine in (moved, dec, pre):
        _assert_idle(engine)


def test_temperature_one_draws_follow_the_target_distribution(tiny_dense: Path) -> None:
    """Three tokens per request, 1,500 seeded draws: the joint frequencies of (t1, t2, t3) match the
    target model's probabilities (chi-square). The logit bias and top_k confine each token to three
    ids that the prompt is made of, so a draft exists at every step; the ids are ones this random
    model spreads its mass over (no context gives one more than 0.85), so both the accepting and
    the rejecting branch are drawn from."""
    spec = make_engine(tiny_dense, speculative=SpeculativeConfig("ngram", 2), max_num_seqs=512, max_num_batched_tokens=1024)
    ids = [533, 1980, 1050]
    g = torch.Generator().manual_seed(0)
    prompt = [ids[i] for i in torch.randint(0, 3, (40,), generator=g).tolist()]
    bias = {t: 100.0 for t in ids}
    draws = 1500
    counts = dict.fromkeys(itertools.product(ids, repeat=3), 0)
    for start in range(0, draws, 500):
        batch = [SamplingParams(max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True, logit_bias=bias,
                                  top_k=3)
                 for seed in range(start, start + 500)]
        for i, params in enumerate(batch):
            spec.add_request(f"s{start + i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while spec.has_unfinished():
            for out in spec.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        for seq in tokens.values():
            counts[tuple(seq)] += 1
    drafted, accepted = _drafted(spec)
    assert drafted == draws and 100 < accepted < draws - 100  # each branch drawn from a hundred times
    expected = {seq: draws * _probability(spec, prompt, seq, ids) for seq in counts}
    assert abs(sum(expected.values()) - draws) < 1e-6 * draws
    common = [seq for seq in counts if expected[seq] >= 5]  # the rest pooled, as chi-square needs
    observed = [counts[seq] for seq in common] + [draws - sum(counts[seq] for seq in common)]
    assert chisquare(observed, [expected[seq] for seq in common] + [draws - sum(expected[s] for s in common)]
                     ).pvalue > 1e-3
    _assert_idle(spec)


def _probability(engine: LLMEngine, prompt: list[int], seq: tuple[int, ...], ids: list[int]) -> float:
    """The target's probability of `seq` after `prompt`, the bias leaving only `ids` possible."""
    logits = prompt_logits(engine, prompt + list(seq[:-1]))[len(prompt) - 1:]
    probs = torch.softmax(logits[:, ids].double(), dim=-1)
    return float(torch.prod(torch.stack([probs[i, ids.index(t)] for i, t in enumerate(seq)])))
