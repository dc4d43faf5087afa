"""KV pulls between mock engines take the profile's link time (`--mock-profile`), as an asyncio
wait that leaves the event loop free; a modelled pull beyond the pull timeout fails like a real
one and the prompt is recomputed. Without a profile mock pulls stay instant (the other tests)."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from tests.disagg.conftest import assert_idle, complete_all, metrics, mixed_prompts, wait_for
from tests.engine.helpers import GREEDY, make_engine
from tokenmill.bench.harness.serve_process import ServeProcess
from tokenmill.engine.async_engine import AsyncLLMEngine, KVImport
from tokenmill.textgen.outputs import FINISH_HANDOFF
from tokenmill.worker.kv_transfer import KVTransferService

PARAMS = dataclasses.replace(GREEDY, max_tokens=6)
PROFILE = "llama-3.1-8b@h100:fp8:tp1"
Pulls = list[tuple[float, float]]  # (started, ended) of each pull, time.monotonic


def mock_service_engine(model: Path, name: str, **kwargs) -> tuple[KVTransferService, AsyncLLMEngine]:
    service = KVTransferService(name, ("shm",), **kwargs)
    engine = make_engine(model, runner="mock", mock_sleep=False, num_kv_blocks=96)
    return service, AsyncLLMEngine(engine)


async def _collect(stream) -> list:
    return [out async for out in stream]


async def _handoff(model: Path, prompts: list[list[int]], transfer_seconds: Callable[[int], float],
                   pull_timeout_s: float = 10.0) -> tuple[list[list[int]], Pulls, list[float], KVTransferService]:
    """Prefill each prompt on one mock engine, pull it into another; (outputs, each pull's
    window, when a task on the same loop ran, the decode service)."""
    pre_svc, pre = mock_service_engine(model, "pre")
    dec_svc, dec = mock_service_engine(model, "dec", pull_timeout_s=pull_timeout_s,
                                       mock_transfer_seconds=transfer_seconds)
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    for svc, engine in ((pre_svc, pre), (dec_svc, dec)):
        await engine.start()
        await svc.start(engine)
    ticker = asyncio.create_task(tick())
    outputs: list[list[int]] = []
    pulls: Pulls = []
    try:
        for i, prompt in enumerate(prompts):
            first = (await _collect(pre.generate(f"r{i}", prompt, PARAMS, prefill_only=True)))[-1]
            assert first.finish_reason == FINISH_HANDOFF
            handle = await pre_svc.handle_for(first)

            async def pull(plan, h=handle) -> bool:
                started = time.monotonic()
                try:
                    return await dec_svc.pull(h, plan)
                finally:
                    pulls.append((started, time.monotonic()))

            rest = await _collect(dec.generate(f"r{i}", prompt + first.new_token_ids,
                                               dataclasses.replace(PARAMS, max_tokens=PARAMS.max_tokens - 1),
                                               output_offset=1, kv_import=KVImport(pull)))
            outputs.append(first.new_token_ids + [t for o in rest for t in o.new_token_ids])
        for _ in range(100):  # acknowledgements are asynchronous
            if (await pre.stats()).num_held == 0:
                break
            await asyncio.sleep(0.05)
        assert (await pre.stats()).num_held == 0
    finally:
        ticker.cancel()
        for svc, engine in ((pre_svc, pre), (dec_svc, dec)):
            await svc.close()
            await engine.stop()
    return outputs, pulls, ticks, dec_svc


def test_a_mock_pull_waits_the_modelled_time_without_blocking_the_loop(tiny_dense: Path) -> None:
    prompt = list(range(5, 5 + 40))  # 40 tokens: 2 full blocks of 16 and a partial one
    asked: list[int] = []

    def transfer_seconds(tokens: int) -> float:
        asked.append(tokens)
        return 0.3

    outputs, pulls, ticks, service = asyncio.run(_handoff(tiny_dense, [prompt, prompt], transfer_seconds))
    expected = make_engine(tiny_dense, runner="mock", mock_sleep=False).generate([prompt], PARAMS)[0]
    assert outputs == [expected, expected]
    # the second time the decode engine's prefix cache holds the 2 full blocks: only the rest moves
    assert asked == [40, 40 - 2 * 16]
    assert service.counters.pulls == 2 and service.counters.pull_failures == 0
    for started, ended in pulls:
        assert ended - started >= 0.3  # a lower bound only: the machine may be slow
        assert any(started < t < ended for t in ticks), "the event loop was blocked during the pull"


def test_a_modelled_pull_beyond_the_timeout_fails_and_is_recomputed(tiny_dense: Path) -> None:
    prompt = list(range(5, 5 + 24))
    outputs, pulls, _, service = asyncio.run(_handoff(tiny_dense, [prompt], lambda tokens: 60.0,
                                                      pull_timeout_s=0.2))
    assert outputs == [make_engine(tiny_dense, runner="mock", mock_sleep=False).generate([prompt], PARAMS)[0]]
    assert service.counters.pull_failures == 1
    assert pulls[0][1] - pulls[0][0] >= 0.2


def test_a_disaggregated_mock_deployment_with_a_profile_serves(
        server_factory: Callable[..., ServeProcess]) -> None:
    prompts = mixed_prompts(6, seed=3)
    server = server_factory("--runner", "mock", "--mock-profile", PROFILE, "--mock-speedup", "20",
                            "--disagg-threshold", "0")
    assert len(complete_all(server, prompts)) == len(prompts)
    key = 'tokenmill_worker_kv_pulls{worker="decode-0"}'
    wait_for(lambda: metrics(server).get(key, 0.0) == len(prompts), 10, "every pull to be counted")
    assert metrics(server).get('tokenmill_worker_kv_pull_failures{worker="decode-0"}', 0.0) == 0
    assert_idle(server)
