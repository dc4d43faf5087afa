"""presence/frequency/repetition penalties and logit_bias: applied on the batch in the sampler,
checked against hand-computed logits, and end to end through the official client."""
from __future__ import annotations

import openai
import pytest
import torch

from tests.api.conftest import MODEL_NAME, Served
from tokenmill.engine.sampler import apply_penalties, sample
from tokenmill.textgen.sampling import SampleRow, SamplingParams


def test_penalties_match_the_openai_and_vllm_formulas_row_by_row() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5], [2.0, 1.0, -1.0, 0.5], [2.0, 1.0, -1.0, 0.5]])
    rows = [SampleRow(SamplingParams(temperature=0.0), 0, [0, 0]),  # no penalty: untouched
            SampleRow(SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25,
                                     logit_bias={3: 1.0}), 3, [0, 0, 2]),
            SampleRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), 1, [2], [1])]
    out = apply_penalties(logits, rows)
    assert out[0].tolist() == [2.0, 1.0, -1.0, 0.5]
    assert out[1].tolist() == pytest.approx([2.0 - 0.5 - 0.5, 1.0, -1.0 - 0.5 - 0.25, 1.5])
    assert out[2].tolist() == pytest.approx([2.0, 0.5, -2.0, 0.5])  # seen: positive /2, negative x2
    assert logits[1].tolist() == [2.0, 1.0, -1.0, 0.5]  # the caller's logits are not changed
    tokens, _ = sample(logits, rows, torch.Generator())
    assert tokens == [0, 3, 0]  # the bias makes token 3 the greedy choice of row 1


@pytest.fixture(scope="module")
def client(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _tokens(client: openai.OpenAI, **fields: object) -> list[str]:
    """The texts of 24 greedy tokens (logprobs name each token)."""
    result = client.completions.create(model=MODEL_NAME, prompt=[11, 12, 13], max_tokens=24, temperature=0.0,
                                       logprobs=0, extra_body={"ignore_eos": True}, **fields)
    return result.choices[0].logprobs.tokens


def test_logit_bias_forces_a_token_and_a_frequency_penalty_pushes_it_back(client: openai.OpenAI) -> None:
    token_42 = _tokens(client, logit_bias={"42": 100})[0]
    assert _tokens(client, logit_bias={"42": 100}) == [token_42] * 24
    plain = _tokens(client)
    assert token_42 not in plain  # the unbiased model does not choose it here
    biased = {"42": 40.0}  # (this checkpoint: enough to win every step, a few steps' worth of penalty)
    assert _tokens(client, logit_bias=biased).count(token_42) == 24
    assert _tokens(client, logit_bias=biased, frequency_penalty=2.0).count(token_42) <= 12
    assert _tokens(client, logit_bias=biased, presence_penalty=2.0, frequency_penalty=2.0).count(token_42) <= 12


def test_a_negative_bias_bans_what_greedy_would_pick(client: openai.OpenAI, server: Served) -> None:
    plain = _tokens(client)
    first_id = server.live.backend.tokenizer.encode(plain[0], add_special_tokens=False)
    assert len(first_id) == 1, f"{plain[0]!r} should be one token of this checkpoint"
    assert _tokens(client, logit_bias={str(first_id[0]): -100})[0] != plain[0]
