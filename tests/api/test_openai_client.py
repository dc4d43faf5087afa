"""The official `openai` client against a live server: both endpoints, streaming and not."""
from __future__ import annotations

import openai
import pytest

from tests.api.conftest import MODEL_NAME, Served
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.textgen.sampling import SamplingParams

PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about foxes."}]


def _client(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _in_process(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[str, int, str | None]:
    """(text, tokens generated, finish reason) from the engine driven directly."""
    engine.add_request("reference", prompt, params)
    text, count, reason = "", 0, None
    while engine.has_unfinished():
        for out in engine.step():
            text += out.new_text
            count += len(out.new_token_ids)
            reason = out.finish_reason
    return text, count, reason


def test_models_list_names_the_served_model(server: Served) -> None:
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_greedy_completion_equals_the_engine_and_streaming_matches(server: Served,
                                                                   reference_engine: LLMEngine) -> None:
    client = _client(server)
    prompt_ids = reference_engine.tokenizer.encode(PROMPT)
    expected, count, _ = _in_process(reference_engine, prompt_ids, SamplingParams(max_tokens=24, temperature=0.0,
                                                                                  ignore_eos=True))
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), count) == \
        (len(prompt_ids), 24)
    assert whole.usage.total_tokens == len(prompt_ids) + 24

    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_accepts_token_ids(server: Served, reference_engine: LLMEngine) -> None:
    prompt_ids = reference_engine.tokenizer.encode(PROMPT)
    expected, _, _ = _in_process(reference_engine, prompt_ids, SamplingParams(max_tokens=8, temperature=0.0))
    whole = _client(server).completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=8, temperature=0)
    assert whole.choices[0].text == expected


def test_greedy_chat_equals_the_engine_and_streaming_matches(server: Served, reference_engine: LLMEngine) -> None:
    client = _client(server)
    prompt_ids = reference_engine.tokenizer.apply_chat_template(CHAT)
    expected, count, reason = _in_process(reference_engine, prompt_ids, SamplingParams(max_tokens=20,
                                                                                       temperature=0.0))
    whole = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=20, temperature=0)
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == {"length": "length", "stop": "stop"}[reason]
    assert whole.usage.completion_tokens == count and whole.usage.prompt_tokens == len(prompt_ids)

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == count
    assert {c.id for c in chunks} == {chunks[0].id}


def test_stream_without_include_usage_sends_no_usage(server: Served) -> None:
    chunks = list(_client(server).chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5,
                                                          temperature=0, stream=True))
    assert chunks and all(c.usage is None and c.choices for c in chunks)


def test_stop_string_cuts_the_text_and_reports_stop(server: Served, reference_engine: LLMEngine) -> None:
    prompt_ids = reference_engine.tokenizer.encode(PROMPT)
    full, _, _ = _in_process(reference_engine, prompt_ids, SamplingParams(max_tokens=24, temperature=0.0,
                                                                          ignore_eos=True))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    whole = _client(server).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                               stop=[stop], extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].text == full[:full.index(stop)]


def test_seeded_sampling_repeats(server: Served) -> None:
    client = _client(server)
    texts = {client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9,
                                       seed=7, extra_body={"top_k": 50}).choices[0].text for _ in range(2)}
    assert len(texts) == 1


def test_an_unseeded_answer_returns_the_seed_that_replays_it(server: Served) -> None:
    client = _client(server)
    fields = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    first = client.completions.create(**fields)
    seed = first.model_extra["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**63
    replayed = client.completions.create(**fields, seed=seed)
    assert replayed.model_extra["seed"] == seed and replayed.choices[0].text == first.choices[0].text
    others = {client.completions.create(**fields).model_extra["seed"] for _ in range(3)}
    assert seed not in others and len(others) == 3  # each request draws its own
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, seed=11, stream=True))
    assert chunks and all(c.model_extra["seed"] == 11 for c in chunks)


@pytest.mark.parametrize("top", [0, 3])
def test_logprobs_in_both_formats(server: Served, top: int) -> None:
    client = _client(server)
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                           logprobs=top, extra_body={"ignore_eos": True})
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(value <= 0.0 for value in lp.token_logprobs)
    assert all(len(t) <= top for t in lp.top_logprobs) and (top == 0 or all(lp.top_logprobs))

    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=top, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == top for c in content)
    if top:  # greedy: the chosen token is the most likely one
        assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)
