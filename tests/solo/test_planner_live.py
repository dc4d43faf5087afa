"""`tokenmill serve --planner sla`: real processes, mock workers priced as 405B on 8 H100s.

The load (1,024-token prompts) runs at 2 req/s, more than doubles past what one replica
sustains, then falls to 0.5 req/s. The planner must add a replica within two of its intervals of the rise, remove
it only after its sustained period once the load falls, and explain each change at
/admin/planner; no request may fail or be cut short meanwhile.
"""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx

from tests.serving.conftest import Server, start_server, stop_server

INTERVAL_S = 3.0
SUSTAIN = 2  # decisions that must agree before a replica is removed
# (requests per second, seconds): one replica sustains ~3.8 req/s of these at the 2 s TTFT target, so
# the first phase fits one even if the host's own slowness makes the correction x1.5
PHASES = ((2.0, 12.0), (4.5, 15.0), (0.5, 15.0))
# after the load, how long the scale-down and the drained replica's exit may still take (both are
# usually seen while the quiet phase still runs: two agreeing intervals after the fall)
TAIL_S = INTERVAL_S * (SUSTAIN + 2) + 6.0
MAX_TOKENS = 4
FLAGS = ("--runner", "mock", "--mock-profile", "llama-3.1-405b@h100:fp8:tp8", "--max-num-batched-tokens", "256",
         "--kv-cache-blocks", "2000", "--planner", "sla", "--predictor", "constant",
         "--planner-interval-s", str(INTERVAL_S), "--scale-down-intervals", str(SUSTAIN), "--max-step", "2",
         "--warmup-s", "3", "--slo-ttft-ms", "2000", "--slo-itl-ms", "200", "--max-agg", "3")


async def _one(client: httpx.AsyncClient, prompt: list[int], results: list[dict]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
    response = await client.post("/v1/completions", json=body)
    results.append({"status": response.status_code, "body": response.json()})


async def _load(url: str, marks: dict[str, float], results: list[dict]) -> None:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, trust_env=False) as client:
        tasks = []
        for index, (rate, seconds) in enumerate(PHASES):
            marks[f"phase{index}"] = time.monotonic()
            for i in range(int(rate * seconds)):
                prompt = [rng.randint(3, 2000) for _ in range(1024)]
                tasks.append(asyncio.create_task(_one(client, prompt, results)))
                await asyncio.sleep(1.0 / rate)
        await asyncio.gather(*tasks)


async def _watch(url: str, marks: dict[str, float], stop: asyncio.Event) -> None:
    """When the planner's first scale-up and first scale-down decisions became visible, and when a
    removed replica was first seen gone."""
    async with httpx.AsyncClient(base_url=url, timeout=10.0, trust_env=False) as client:
        while not stop.is_set():
            decisions = (await client.get("/admin/planner", params={"last": "500"})).json()["data"]
            for d in decisions:
                for action in d["actions"]:
                    key = "up" if action["delta"] > 0 else "down"
                    marks.setdefault(key, time.monotonic())
            workers = (await client.get("/admin/workers")).json()["data"]
            if any(w["state"] == "gone" for w in workers):
                marks.setdefault("gone", time.monotonic())
            await asyncio.sleep(0.25)


async def _run(url: str) -> tuple[dict[str, float], list[dict]]:
    marks: dict[str, float] = {}
    results: list[dict] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(url, marks, stop))
    await _load(url, marks, results)
    deadline = time.monotonic() + TAIL_S
    while not {"down", "gone"} <= marks.keys() and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    stop.set()
    await watcher
    return marks, results


def test_the_planner_scales_a_live_fleet_up_and_down_and_explains_it(tiny_dense: Path, tmp_path: Path) -> None:
    server: Server = start_server(tiny_dense, tmp_path / "run", *FLAGS)
    try:
        marks, results = asyncio.run(_run(server.url))
        decisions = httpx.get(server.url + "/admin/planner", params={"last": "500"}).json()["data"]
        metrics = httpx.get(server.url + "/metrics").text
        workers = httpx.get(server.url + "/admin/workers").json()["data"]
    finally:
        stop_server(server)
    assert len(results) == sum(int(rate * seconds) for rate, seconds in PHASES)
    for result in results:  # nothing failed, nothing was cut short
        assert result["status"] == 200, result
        choice = result["body"]["choices"][0]
        assert choice["finish_reason"] == "length" and result["body"]["usage"]["completion_tokens"] == MAX_TOKENS
    assert "up" in marks, [d["reason"] for d in decisions]
    # the first interval after the rise may straddle it; the second is all of it (plus polling slack)
    assert 0 <= marks["up"] - marks["phase1"] <= 2 * INTERVAL_S + 1.5  # not before the rise
    assert "down" in marks and marks["down"] - marks["phase2"] >= (SUSTAIN - 1) * INTERVAL_S
    changed = [d for d in decisions if d["actions"]]
    assert changed and all(any(f"{a['delta']:+d} {a['role']}" in d["reason"] for a in d["actions"]) for d in changed)
    assert all(d["reason"] for d in decisions)
    assert 'tokenmill_planner_replicas{role="agg"}' in metrics
    assert 'tokenmill_planner_decisions_total{kind="scale_up"}' in metrics
    assert any(w["state"] == "gone" for w in workers)  # the removed replica drained and left
