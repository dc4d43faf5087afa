"""n > 1 and several prompts per /v1/completions, through the official client: indexed choices,
seeded and distinct, one prefill shared by a prompt's choices, streams that add up to the whole."""
from __future__ import annotations

import random
from collections import defaultdict

import openai
import pytest

from tests.api.conftest import MODEL_NAME, Served
from tests.api.helpers import metric, wait_for_metric


@pytest.fixture(scope="module")
def client(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _prompt(seed: int, length: int = 70) -> list[int]:
    rng = random.Random(seed)  # a prompt no other test sent: its blocks are cached only by this request
    return [rng.randint(3, 2000) for _ in range(length)]


def test_n_choices_are_indexed_seeded_distinct_and_counted(client: openai.OpenAI) -> None:
    fields = dict(model=MODEL_NAME, prompt=_prompt(1), max_tokens=8, temperature=1.0, seed=7, n=3,
                  extra_body={"ignore_eos": True})
    first, again = client.completions.create(**fields), client.completions.create(**fields)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) == 3                       # each choice draws from its own seed stream
    assert texts == [c.text for c in again.choices]   # and stays reproducible
    assert first.usage.prompt_tokens == 70 and first.usage.completion_tokens == 3 * 8


def test_a_prompts_choices_share_its_prefill(client: openai.OpenAI, server: Served) -> None:
    before = metric(server.url, "tokenmill_cached_tokens_total")
    client.completions.create(model=MODEL_NAME, prompt=_prompt(2), max_tokens=4, n=3, temperature=0.0)
    after = wait_for_metric(server.url, "tokenmill_cached_tokens_total", before + 1)
    assert after - before >= 2 * 64  # the 2 later choices found the prompt's 4 full blocks cached


def test_a_stream_of_n_choices_adds_up_to_the_whole_response(client: openai.OpenAI) -> None:
    fields = dict(model=MODEL_NAME, prompt=_prompt(3), max_tokens=6, temperature=1.0, seed=3, n=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**fields)
    texts: dict[int, str] = defaultdict(str)
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **fields):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert dict(texts) == {c.index: c.text for c in whole.choices}
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens == 70


def test_several_prompts_give_their_choices_in_prompt_order(client: openai.OpenAI) -> None:
    prompts = [_prompt(4, 20), _prompt(5, 30)]
    result = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, n=2, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, temperature=0.0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert [c.text for c in result.choices] == [alone[0], alone[0], alone[1], alone[1]]  # greedy: repeats
    assert result.usage.prompt_tokens == 50 and result.usage.completion_tokens == 4 * 5


def test_chat_streams_open_every_choice_with_the_assistant_role(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, n=2, stream=True, temperature=0.0)
    roles: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role:
                roles[choice.index] = choice.delta.role
            if choice.finish_reason:
                finished.add(choice.index)
    assert roles == {0: "assistant", 1: "assistant"} and finished == {0, 1}
