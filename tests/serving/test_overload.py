"""A full worker answers 429 with Retry-After instead of queueing without bound."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import start_server, stop_server


@pytest.fixture(scope="module")
def small_queue_server(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory):
    server = start_server(tiny_dense, tmp_path_factory.mktemp("run"), "--runner", "mock",
                          "--mock-step-time", "0.01,0,0,0", "--max-num-seqs", "2", "--max-queue", "2")
    try:
        yield server
    finally:
        stop_server(server)


def test_queue_limit_gives_429s_and_accepted_requests_complete(small_queue_server) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.post("/v1/completions", json={
            "model": "tiny", "prompt": [5, 6, 7, i + 8], "max_tokens": 30, "ignore_eos": True})

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=small_queue_server.url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(20)))

    responses = asyncio.run(main())
    rejected = [r for r in responses if r.status_code == 429]
    accepted = [r for r in responses if r.status_code == 200]
    assert len(rejected) + len(accepted) == 20
    assert 4 <= len(accepted) < 20 and rejected
    assert all(float(r.headers["retry-after"]) > 0 for r in rejected)
    assert all(r.json()["error"]["type"] for r in rejected)
    assert all(r.json()["usage"]["completion_tokens"] == 30 for r in accepted)
    after = httpx.post(small_queue_server.url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": [5, 6], "max_tokens": 3, "ignore_eos": True})
    assert after.status_code == 200  # still serving
