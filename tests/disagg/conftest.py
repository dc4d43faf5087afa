"""Disaggregated deployments of the tiny model, and what the tests check them against."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from tokenmill.bench.harness.serve_process import ServeProcess, start_serve, stop
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.textgen.sampling import SamplingParams
from tokenmill.transfer.memory import SHM_DIR

MAX_TOKENS = 12
KV_BLOCKS = "384"


def serve(model: Path, run_dir: Path, *flags: str) -> ServeProcess:
    """`tokenmill serve` of the tiny model: 1 prefill + 1 decode worker unless flags say otherwise."""
    workers = 1
    if "--prefill" not in flags and "--workers" not in flags:
        flags = ("--prefill", "1", "--decode", "1", *flags)
    if "--prefill" in flags:
        i = flags.index("--prefill")
        workers = int(flags[i + 1]) + int(flags[flags.index("--decode") + 1])
    return start_serve(["--model", str(model), "--served-model-name", "tiny", "--kv-cache-blocks", KV_BLOCKS,
                        "--max-num-seqs", "16", *flags], workers, run_dir, run_dir / "serve.log",
                       start_timeout_s=120)


@pytest.fixture
def server_factory(tiny_dense: Path, tmp_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    started: list[ServeProcess] = []

    def make(*flags: str) -> ServeProcess:
        started.append(serve(tiny_dense, tmp_path / f"run{len(started)}", *flags))
        return started[-1]

    yield make
    leftovers = []
    for server in started:
        pids = {int(entry["pid"]) for entry in server.registry()}
        stop(server)
        leftovers += [path.name for pid in pids for path in SHM_DIR.glob(f"tokenmill-{pid}-*")]
    assert not leftovers, f"shared memory left behind by stopped workers: {leftovers}"


def mixed_prompts(count: int, seed: int = 0, vocab: int = 2048) -> list[list[int]]:
    """Token-id prompts from 3 to ~300 tokens, some sharing a 64-token prefix."""
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(64)]
    out = []
    for i in range(count):
        n = rng.choice([3, 10, 40, 90, 180, 300]) + rng.randrange(8)
        tail = [rng.randrange(3, vocab) for _ in range(n)]
        out.append(shared + tail if i % 4 == 0 else tail)
    return out


def reference(model: Path, prompts: Sequence[list[int]]) -> list[str]:
    """What one in-process engine generates (greedy) for each prompt, as text."""
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=512))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [engine.tokenizer.decode(ids) for ids in engine.generate([list(p) for p in prompts], params)]


async def _complete(client: httpx.AsyncClient, url: str, prompt: list[int], limit: asyncio.Semaphore) -> str:
    async with limit:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        reply = await client.post(url + "/v1/completions", json=body, timeout=120)
        reply.raise_for_status()
        result = reply.json()
        if result["usage"]["completion_tokens"] != MAX_TOKENS:
            raise AssertionError(f"{result['usage']} for a {len(prompt)}-token prompt")
        return str(result["choices"][0]["text"])


def complete_all(server: ServeProcess, prompts: Sequence[list[int]], concurrency: int = 8) -> list[str]:
    """Every prompt through the server's completions endpoint; the generated texts."""
    async def run() -> list[str]:
        limit = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(trust_env=False) as client:
            return list(await asyncio.gather(*(_complete(client, server.url, p, limit) for p in prompts)))
    return asyncio.run(run())


def metrics(server: ServeProcess) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", trust_env=False, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("tokenmill_") and " " in line:
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def assert_idle(server: ServeProcess, timeout_s: float = 20.0, required: Sequence[str] | None = None) -> None:
    """Every registered worker (at least those `required`, default all) back to no requests, no
    held or importing KV and no referenced block."""
    keys = ("kv_usage", "num_running", "num_waiting", "num_held", "num_importing", "in_flight")

    def idle() -> bool:
        entries = server.registry()
        present = {w["worker_id"] for w in entries}
        if required is None and len(entries) != server.num_workers or not set(required or ()) <= present:
            return False
        return all(all(w["metadata"].get(k, 1) == 0 for k in keys) for w in entries)
    wait_for(idle, timeout_s, "every worker to be idle with no KV referenced")


def worker_pid(server: ServeProcess, worker_id: str) -> int:
    for entry in server.registry():
        if entry["worker_id"] == worker_id:
            return int(entry["pid"])
    raise LookupError(worker_id)


def signal_worker(server: ServeProcess, worker_id: str, sig: signal.Signals) -> int:
    pid = worker_pid(server, worker_id)
    os.kill(pid, sig)
    return pid
