"""Seeded sampling, top-k/top-p, stop conditions and logprobs."""
from pathlib import Path

import torch

from tests.engine.helpers import make_engine, prompts
from tokenmill.engine.request import Request
from tokenmill.engine.sampler import sample
from tokenmill.textgen.sampling import SampleRow, SamplingParams


def _run(engine, prompt, params, rid="x"):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_same_seed_same_tokens_whatever_the_batch(tiny_moe: Path) -> None:
    engine = make_engine(tiny_moe)
    p = prompts(engine, 4, seed=10)
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    alone = engine.generate([p[0]], params)[0]
    together = engine.generate(p, params)[0]
    other_seed = engine.generate([p[0]], SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert alone == together
    assert alone != other_seed


def test_top_k_one_is_greedy_and_top_p_limits_the_support() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0]]).repeat(200, 1)
    top1 = [SampleRow(SamplingParams(temperature=1.0, top_k=1), i) for i in range(200)]
    assert set(sample(logits, top1, g)[0]) == {1}
    # p(1) ~= 0.51, p(2) ~= 0.46, p(0) ~= 0.03: top_p=0.5 keeps only token 1; 0.95 keeps 1 and 2.
    narrow = [SampleRow(SamplingParams(temperature=1.0, top_p=0.5), i) for i in range(200)]
    assert set(sample(logits, narrow, g)[0]) == {1}
    wide = [SampleRow(SamplingParams(temperature=1.0, top_p=0.95), i) for i in range(200)]
    assert set(sample(logits, wide, g)[0]) == {1, 2}


def test_stop_token_ids_and_max_tokens(tiny_dense: Path) -> None:
    engine = make_engine(tiny_dense)
    prompt = prompts(engine, 1, seed=11)[0]
    free = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert len(free) == 12
    stop_at = free[5]
    outs = _run(engine, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=[stop_at]))
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == free[: free.index(stop_at) + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop_at


def test_stop_string_is_cut_from_the_text(tiny_dense: Path) -> None:
    engine = make_engine(tiny_dense)
    prompt = engine.tokenizer.encode("It was a truth universally acknowledged")
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    full = "".join(o.new_text for o in _run(engine, prompt, params))
    assert len(full) > 12
    stop = full[8:11]
    outs = _run(engine, prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))
    text = "".join(o.new_text for o in outs)
    assert text == full[: full.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def test_logprobs_are_normalised_and_include_the_sampled_token(tiny_dense: Path) -> None:
    engine = make_engine(tiny_dense)
    outs = _run(engine, prompts(engine, 1, seed=12)[0],
                SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3))
    for o in outs:
        (lp,) = o.new_logprobs
        assert lp.token_id == o.new_token_ids[0]
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the best token
        assert lp.logprob <= 0 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_eos_ends_generation_unless_ignored(tiny_dense: Path) -> None:
    engine = make_engine(tiny_dense)
    eos = min(engine.tokenizer.eos_token_ids)
    logits = torch.full((1, engine.model_config.vocab_size), -10.0)
    logits[0, eos] = 10.0
    tok, _ = sample(logits, [SampleRow(SamplingParams(temperature=0.0), 0)], torch.Generator())
    request = Request("r", [5], SamplingParams(max_tokens=10))
    assert engine.output.check_token_stop(request, tok[0]) == ("stop", None)
    ignoring = Request("r", [5], SamplingParams(max_tokens=10, ignore_eos=True))
    assert engine.output.check_token_stop(ignoring, tok[0]) is None


def test_a_migrated_request_is_penalised_for_what_it_generated_before(tiny_dense) -> None:
    """Continuing elsewhere (prompt + the first k outputs, output_offset=k) gives the same tokens:
    the penalties count the k tokens generated before the move as well."""
    engine = make_engine(tiny_dense)
    prompt = prompts(engine, 1, seed=21)[0]
    # token 42 wins while its count is low: after the move it must stay penalised for its count
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=1.0,
                            presence_penalty=0.5, logit_bias={42: 30.0})
    whole = engine.generate([prompt], params)[0]
    k = 10
    assert 2 <= whole[:k].count(42) < k  # the bias and the penalty both bite before the move
    engine.add_request("moved", prompt + whole[:k], SamplingParams(**{**_fields(params), "max_tokens": 24 - k}),
                       output_offset=k)
    rest: list[int] = []
    while engine.has_unfinished():
        rest += [t for out in engine.step() for t in out.new_token_ids]
    assert rest == whole[k:]


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}
