"""Pinning from the frontend side: the body of `POST /admin/pin`, and the in-process backend."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tokenmill.api.errors import APIError
from tokenmill.api.routes_admin import pin_token_ids
from tokenmill.embedded_backend import LocalBackend
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.textgen.tokenizer import Tokenizer


def test_pin_body_forms(tiny_dense: Path) -> None:
    tokenizer = Tokenizer(tiny_dense)
    assert pin_token_ids({"prompt": [3, 4, 5]}, tokenizer) == [3, 4, 5]
    assert pin_token_ids({"prompt": "a system prompt"}, tokenizer) == tokenizer.encode("a system prompt")
    messages = [{"role": "system", "content": "You answer from the corpus."}]
    chat = pin_token_ids({"messages": messages}, tokenizer)
    follow = tokenizer.apply_chat_template([*messages, {"role": "user", "content": "hi"}])
    assert chat and follow[:len(chat)] == chat  # a prefix of every conversation starting with it
    for body in ({}, {"prompt": [1], "messages": messages}, {"prompt": []}, {"prompt": [1, True]},
                 {"messages": "no"}, [1, 2]):
        with pytest.raises(APIError):
            pin_token_ids(body, tokenizer)


def test_local_backend_pins_in_its_engine(tiny_dense: Path) -> None:
    gauges: list[str] = []

    async def scenario(engine: LLMEngine) -> dict[str, str | None]:
        backend = LocalBackend(AsyncLLMEngine(engine), "tiny")
        await backend.start()
        try:
            gauges[:] = list(backend.metrics_snapshot())
            return await backend.pin_prefix(list(range(20, 60)))
        finally:
            await backend.stop()

    tiered = LLMEngine(EngineConfig(model=str(tiny_dense), num_kv_blocks=32, kv_host_gb=0.01))
    assert asyncio.run(scenario(tiered)) == {"local": None}
    assert 'tokenmill_worker_kv_tier_capacity_bytes{tier="host",worker="local"}' in gauges
    plain = LLMEngine(EngineConfig(model=str(tiny_dense), num_kv_blocks=32))
    assert "--kv-host-gb" in (asyncio.run(scenario(plain))["local"] or "")
    assert not any("kv_tier" in g for g in gauges)
