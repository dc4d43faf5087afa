"""`tokenmill serve --deterministic` over real processes: a seeded request at temperature 1 gives
the tokens and logprobs of the in-process engine, bit for bit, on a cold and a warm worker, amid
other requests, after its prefix went to the host or the disk tier and back, through a worker killed
mid-stream (the other recomputes and continues), disaggregated (its KV pulled from a prefill
worker), and through either of two frontends."""
from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import Server, start_server, stop_server
from tests.serving.probes import kill_the_routed_worker, metric, stream_with_a_kill, wait
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.textgen.sampling import SamplingParams

PROMPT = [random.Random(36).randrange(3, 500) for _ in range(90)]
SEED, MAX_TOKENS = 99, 24
SAMPLED = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": SEED,
           "logprobs": 2, "ignore_eos": True}


def _reference(model: Path) -> list[float]:
    """The request's logprobs from the in-process engine, alone, with the engine's defaults."""
    engine = LLMEngine(EngineConfig(model=str(model), deterministic=True))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED, logprobs=2,
                                                   ignore_eos=True))
    logprobs = []
    while engine.has_unfinished():
        logprobs += [lp.logprob for out in engine.step() for lp in out.new_logprobs]
    return logprobs


def _logprobs(server: Server, **fields: object) -> list[float]:
    body = httpx.post(server.url + "/v1/completions", json={**SAMPLED, **fields}, timeout=60).json()
    return body["choices"][0]["logprobs"]["token_logprobs"]


async def _amid_others(server: Server, count: int) -> list[float]:
    """The request sent with `count` others of other prompts, lengths and seeds at once."""
    rng = random.Random(5)
    others = [{**SAMPLED, "prompt": [rng.randrange(3, 500) for _ in range(rng.randint(10, 150))],
               "seed": rng.randrange(1000), "max_tokens": rng.randint(8, 40)} for _ in range(count)]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        answers = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in [*others, SAMPLED]))
    return answers[-1].json()["choices"][0]["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module")
def reference(tiny_moe: Path) -> list[float]:
    return _reference(tiny_moe)


@pytest.fixture(scope="module")
def fleet(tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two deterministic workers, each with a small device pool (40 blocks), a host tier and
    32-token chunks."""
    server = start_server(tiny_moe, tmp_path_factory.mktemp("run"), "--deterministic", "--kv-cache-blocks", "40",
                          "--kv-host-gb", "0.02", "--max-num-batched-tokens", "32", "--router", "kv", workers=2)
    try:
        yield server
    finally:
        stop_server(server)


def test_every_worker_runs_the_deterministic_kernels(fleet: Server) -> None:
    entries = fleet.registry()
    assert len(entries) == 2 and all(e["metadata"]["deterministic"] is True for e in entries)


def test_cold_warm_and_crowded_answers_are_the_in_process_engines(fleet: Server, reference: list[float]) -> None:
    assert len(reference) == MAX_TOKENS
    assert _logprobs(fleet) == reference  # cold
    cached = metric(fleet.url, "tokenmill_cached_tokens_total")
    assert _logprobs(fleet) == reference  # its prompt cached where the router sends it
    wait(lambda: metric(fleet.url, "tokenmill_cached_tokens_total") >= cached + 80, "its 5 full blocks found cached")
    assert asyncio.run(_amid_others(fleet, 12)) == reference
    assert _logprobs(fleet, seed=SEED + 1) != reference  # the comparison can fail


def _fill(server: Server, rng: random.Random) -> None:
    """16 x 300 new tokens, more than the workers' 40-block device pools hold: the older blocks
    leave them for the tiers below."""
    for _ in range(16):
        prompt = [rng.randrange(3, 500) for _ in range(300)]
        assert httpx.post(server.url + "/v1/completions", timeout=60,
                          json={**SAMPLED, "prompt": prompt, "max_tokens": 2}).status_code == 200


def _restored_from(server: Server, tier: str, reference: list[float]) -> None:
    assert _logprobs(server) == reference
    before = metric(server.url, "tokenmill_worker_kv_tier_hits", tier=tier)
    _fill(server, random.Random(8))
    assert _logprobs(server) == reference
    wait(lambda: metric(server.url, "tokenmill_worker_kv_tier_hits", tier=tier) > before, f"a {tier}-tier hit")


def test_an_answer_restored_from_the_host_tier_is_the_same(fleet: Server, reference: list[float]) -> None:
    _restored_from(fleet, "host", reference)


def test_a_stream_through_a_killed_worker_is_the_undisturbed_one(fleet: Server) -> None:
    fields = {"temperature": 1.0, "seed": 7}
    prompt, tokens = PROMPT[:40], 400
    undisturbed, _ = stream_with_a_kill(fleet.url, prompt, tokens, lambda: 0, after_chunks=1, **fields)
    migrations = metric(fleet.url, "tokenmill_request_migrations_total")
    wait(lambda: metric(fleet.url, "tokenmill_router_worker_load_blocks") == 0, "the router's load back to zero")
    text, _ = stream_with_a_kill(fleet.url, prompt, tokens, lambda: kill_the_routed_worker(fleet), after_chunks=1,
                                 **fields)
    assert metric(fleet.url, "tokenmill_request_migrations_total") == migrations + 1
    assert text == undisturbed
    wait(lambda: len(fleet.registry()) == 2, "the supervisor restarting the killed worker", 60)


def test_disaggregated_answers_are_the_in_process_engines(tiny_moe: Path, tmp_path: Path,
                                                         reference: list[float]) -> None:
    server = start_server(tiny_moe, tmp_path / "run", "--deterministic", "--prefill", "1", "--decode", "1",
                          "--disagg-threshold", "0", "--kv-cache-blocks", "256", workers=2)
    try:
        assert _logprobs(server) == reference
        # its KV came from the prefill worker (the count arrives with the decode worker's heartbeat)
        wait(lambda: metric(server.url, "tokenmill_worker_kv_pulls") >= 1, "the decode worker's pull")
    finally:
        stop_server(server)


def test_answers_through_two_frontends_and_the_disk_tier_are_the_in_process_engines(
        tiny_moe: Path, tmp_path: Path, reference: list[float]) -> None:
    """One worker (no other to route to) with a disk tier and no host tier, so that its evicted
    blocks go straight to disk, behind two frontends sharing the port (both connected to it; the
    kernel spreads the fresh connections over them)."""
    server = start_server(tiny_moe, tmp_path / "run", "--deterministic", "--api-servers", "2", "--kv-cache-blocks",
                          "40", "--kv-disk-dir", str(tmp_path / "kv-disk"), workers=1)
    try:
        wait(lambda: [w["metadata"].get("frontends") for w in server.registry()] == [2], "both frontends connected")
        for _ in range(6):  # a fresh connection each (httpx.post): the kernel spreads them over both servers
            assert _logprobs(server) == reference
        _restored_from(server, "disk", reference)
    finally:
        stop_server(server)
