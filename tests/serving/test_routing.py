"""KV-aware routing end to end: 4 mock-runner workers, a shared-prefix workload.

Each worker's pool holds about a quarter of the prefixes, so only routing that keeps a
group on one worker can realise the hits.
"""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import start_server, stop_server

GROUPS, PER_GROUP, PREFIX, SUFFIX = 16, 8, 512, 32


def _run_workload(url: str) -> int:
    """Rounds of one prompt per group, groups shuffled each round; returns cached prompt tokens."""
    rng = random.Random(0)
    prefixes = [[rng.randint(3, 2000) for _ in range(PREFIX)] for _ in range(GROUPS)]

    async def main() -> int:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            cached = 0
            for _ in range(PER_GROUP):
                order = rng.sample(range(GROUPS), GROUPS)
                bodies = [{"model": "tiny", "prompt": prefixes[g] + [rng.randint(3, 2000) for _ in range(SUFFIX)],
                           "max_tokens": 4, "ignore_eos": True} for g in order]
                responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
                assert all(r.status_code == 200 for r in responses)
                cached += sum(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses)
            return cached

    return asyncio.run(main())


@pytest.mark.parametrize("policy", ["kv", "round-robin"])
def test_kv_routing_realises_the_prefix_hits_and_balances_load(policy: str, tiny_dense: Path,
                                                                tmp_path: Path) -> None:
    server = start_server(tiny_dense, tmp_path, "--runner", "mock", "--mock-step-time", "0.002,0.00002,0,0",
                          "--router", policy, "--kv-cache-blocks", "200", workers=4)
    try:
        cached = _run_workload(server.url)
        time.sleep(1.0)  # let a heartbeat carry the final counts into the registry
        served = [w["metadata"]["requests_served"] for w in server.registry()]
    finally:
        stop_server(server)
    achievable = GROUPS * (PER_GROUP - 1) * PREFIX
    if policy == "kv":
        assert cached >= 0.9 * achievable
        assert max(served) <= 1.5 * (sum(served) / len(served))
    else:
        assert cached <= 0.5 * achievable
