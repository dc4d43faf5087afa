"""End to end: the official OpenAI client against `tokenmill serve` with real worker processes."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai

from tests.serving.conftest import Server
from tests.serving.probes import busy_worker_pid, in_flight_by_pid, stream_with_a_kill
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.textgen.sampling import SamplingParams

PROMPT = "It was a truth universally acknowledged, that a single man"


def _reference(model: Path, prompt_ids: list[int], max_tokens: int) -> str:
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=512))
    out = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    return engine.tokenizer.decode(out)


def test_completions_and_chat_match_the_in_process_engine(two_worker_server: Server, tiny_dense: Path) -> None:
    client = openai.OpenAI(base_url=two_worker_server.url + "/v1", api_key="none")
    engine = LLMEngine(EngineConfig(model=str(tiny_dense), num_kv_blocks=512))
    prompt_ids = engine.tokenizer.encode(PROMPT)
    expected = _reference(tiny_dense, prompt_ids, 24)
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == expected
    assert done.usage.completion_tokens == 24 and done.usage.prompt_tokens == len(prompt_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if c.choices)
    assert streamed == expected
    messages = [{"role": "user", "content": "Hello there"}]
    chat_ids = engine.tokenizer.apply_chat_template(messages)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == _reference(tiny_dense, chat_ids, 16)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16


def test_pin_without_tiers_names_the_flag(two_worker_server: Server) -> None:
    """A pin needs a KV tier: each worker says which flag would give it one (before any worker
    of this module's server is killed below)."""
    answer = httpx.post(two_worker_server.url + "/admin/pin", json={"prompt": list(range(20, 60))}, timeout=30)
    assert answer.status_code == 200
    body = answer.json()
    assert body["pinned"] is False and len(body["workers"]) == 2
    assert all("--kv-host-gb" in why for why in body["workers"].values())


def test_64_concurrent_streams_account_for_every_token(two_worker_server: Server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int]:
        stream = await client.completions.create(
            model="tiny", prompt=[5 + i, 6, 7, 8 + i], max_tokens=8 + i % 9, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage, pieces = None, 0
        async for chunk in stream:
            pieces += bool(chunk.choices and chunk.choices[0].text)
            usage = chunk.usage or usage
        return usage.completion_tokens, 8 + i % 9

    async def main() -> list[tuple[int, int]]:
        # one client loop opens 64 connections while it parses 64 streams: on a busy host a connect
        # can wait past the SDK's 5 s connect timeout in this process, not in the server
        client = openai.AsyncOpenAI(base_url=two_worker_server.url + "/v1", api_key="none", max_retries=0,
                                    timeout=120.0)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert all(got == want for got, want in results)


def test_killing_a_worker_mid_stream_migrates_without_a_visible_seam(two_worker_server: Server,
                                                                      tiny_dense: Path) -> None:
    prompt = [11, 12, 13, 14, 15, 16, 17]
    undisturbed = _reference(tiny_dense, prompt, 1500)

    def kill_busy_worker() -> int:
        pid = busy_worker_pid(two_worker_server, before)
        os.kill(pid, signal.SIGKILL)
        return pid

    before = in_flight_by_pid(two_worker_server)
    text, _ = stream_with_a_kill(two_worker_server.url, prompt, 1500, kill_busy_worker)
    assert text == undisturbed
    _wait_for(lambda: len(two_worker_server.registry()) == 2, 60)  # the supervisor restarted it


def _wait_for(cond, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_client_disconnect_frees_the_workers_blocks(two_worker_server: Server) -> None:
    _wait_for(lambda: all(w["metadata"].get("kv_usage", 1) == 0 for w in two_worker_server.registry()), 30)
    with httpx.stream("POST", two_worker_server.url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": [20, 21, 22], "max_tokens": 1500, "stream": True,
                            "ignore_eos": True}) as response:
        lines = response.iter_lines()
        for _ in range(20):
            next(lines)
        _wait_for(lambda: any(w["metadata"].get("kv_usage", 0) > 0 for w in two_worker_server.registry()), 5)
    _wait_for(lambda: all(w["metadata"].get("kv_usage", 1) == 0 and w["metadata"].get("in_flight", 1) == 0
                          for w in two_worker_server.registry()), 30)


def test_a_request_the_worker_refuses_is_a_400_naming_the_field(two_worker_server: Server) -> None:
    response = httpx.post(two_worker_server.url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": [5, 6, 10**6], "max_tokens": 3})
    assert response.status_code == 400
    assert "prompt" in response.json()["error"]["message"]
    assert httpx.get(two_worker_server.url + "/health", timeout=5).status_code == 200
