"""AsyncLLMEngine over the mock runner steps inline on the event loop (no engine thread) and
awaits each step's modelled end; over the torch runner it keeps its engine thread."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from tests.engine.helpers import make_engine, prompts
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.mock_runner import MockRunner, StepTimeModel
from tokenmill.textgen.sampling import SamplingParams

ENGINE_THREAD = "engine-loop"
# Only a guard against a hang: the tests assert outcomes, never speed.
_GUARD_S = 60.0


def _engine_threads(besides: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """Live engine threads, other than `besides` (those of engines other tests keep running,
    such as the frontend tests' session servers)."""
    return [t for t in threading.enumerate() if t.name == ENGINE_THREAD and t not in besides]


async def _collect(engine: AsyncLLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(rid, prompt, params):
        tokens += out.new_token_ids
    return tokens


async def _wait_free(engine: AsyncLLMEngine) -> tuple[int, int]:
    """(free blocks, all blocks) once every block is free again (or when the guard runs out)."""
    pool = engine.engine.pool
    deadline = time.monotonic() + _GUARD_S
    while pool.num_free_blocks != pool.num_blocks and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return pool.num_free_blocks, pool.num_blocks


def test_mock_engine_steps_inline_and_streams_the_synchronous_tokens(tiny_moe: Path) -> None:
    sync = make_engine(tiny_moe, runner="mock", mock_sleep=False)
    batch = prompts(sync, 6, seed=31)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = sync.generate(batch, params)
    others = frozenset(_engine_threads())

    async def main() -> tuple[list[list[int]], list[threading.Thread], bool]:
        engine = AsyncLLMEngine(make_engine(tiny_moe, runner="mock", mock_sleep=False))
        await engine.start()
        try:
            streams = asyncio.gather(*(_collect(engine, f"r{i}", p, params) for i, p in enumerate(batch)))
            await asyncio.sleep(0)
            threads_while_running = _engine_threads(others)
            running = engine.is_running()
            return await asyncio.wait_for(streams, _GUARD_S), threads_while_running, running
        finally:
            await engine.stop()

    tokens, threads, running = asyncio.run(main())
    assert threads == [] and running
    assert tokens == expected
    assert all(len(t) == 10 for t in tokens)


def test_the_loop_keeps_running_through_a_modelled_step(tiny_dense: Path) -> None:
    step_s, max_tokens = 0.2, 3
    engine_sync = make_engine(tiny_dense, runner="mock", mock_step_time=StepTimeModel(a=step_s, b=0, c=0, d=0))
    prompt = prompts(engine_sync, 1, seed=32)[0]

    async def main() -> tuple[list[int], int, float, float, int]:
        engine = AsyncLLMEngine(engine_sync)
        await engine.start()
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                await asyncio.sleep(0.01)
                ticks += 1

        try:
            ticking = asyncio.create_task(ticker())
            started = time.perf_counter()
            tokens = await asyncio.wait_for(_collect(engine, "r", prompt, SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)), _GUARD_S)
            wall = time.perf_counter() - started
            stop.set()
            await ticking
        finally:
            await engine.stop()
        runner = engine.engine.runner
        assert isinstance(runner, MockRunner)
        return tokens, ticks, wall, runner.modelled_seconds, engine.engine.stats().num_steps

    tokens, ticks, wall, modelled, steps = asyncio.run(main())
    assert len(tokens) == max_tokens
    assert steps == max_tokens and modelled == pytest.approx(step_s * steps)
    assert wall >= modelled  # the steps' modelled time is waited out, not skipped
    assert ticks / steps >= 5, f"{ticks} ticks of 10 ms over {steps} steps of {step_s} s"


@pytest.mark.parametrize("mock_sleep", [False, True], ids=["no-sleep", "modelled-steps"])
def test_cancelling_a_consumer_aborts_its_request_and_frees_its_blocks(tiny_dense: Path, mock_sleep: bool) -> None:
    # With modelled steps (20 ms each), the cancellation lands while a step's end is awaited.
    engine_sync = make_engine(tiny_dense, runner="mock", mock_sleep=mock_sleep,
                              mock_step_time=StepTimeModel(a=0.02, b=0, c=0, d=0))
    long_prompt, short_prompt = prompts(engine_sync, 2, seed=33, low=40, high=60)
    endless = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[int, bool, int, list[int], tuple[int, int]]:
        engine = AsyncLLMEngine(engine_sync)
        await engine.start()
        try:
            pool = engine.engine.pool
            streamed = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.generate("long", long_prompt, endless):
                    streamed.set()

            task = asyncio.create_task(consume())
            other = asyncio.create_task(_collect(engine, "short", short_prompt, short))
            await asyncio.wait_for(streamed.wait(), _GUARD_S)
            held = pool.num_blocks - pool.num_free_blocks
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            long_still_known = "long" in engine.engine.requests
            other_tokens = await asyncio.wait_for(other, _GUARD_S)  # the other request is unaffected
            stats = await engine.stats()
            return held, long_still_known, stats.num_running + stats.num_waiting, other_tokens, await _wait_free(engine)
        finally:
            await engine.stop()

    held, long_still_known, left, other_tokens, (free, total) = asyncio.run(main())
    assert held > 0  # the long request did hold blocks
    assert not long_still_known  # inline, the abort runs as the consumer's stream closes
    assert left == 0
    assert len(other_tokens) == 8
    assert free == total


def test_the_torch_runner_keeps_its_engine_thread(tiny_dense: Path) -> None:
    others = frozenset(_engine_threads())

    async def main() -> tuple[list[threading.Thread], bool, list[int], list[threading.Thread]]:
        engine = AsyncLLMEngine(make_engine(tiny_dense))
        await engine.start()
        try:
            while_running = _engine_threads(others)
            tokens = await asyncio.wait_for(_collect(engine, "r", [5] * 8, SamplingParams(
                max_tokens=2, temperature=0.0, ignore_eos=True)), _GUARD_S)
            alive = engine.is_running()
        finally:
            await engine.stop()
        return while_running, alive, tokens, _engine_threads(others)

    while_running, alive, tokens, after_stop = asyncio.run(main())
    assert len(while_running) == 1 and while_running[0].daemon
    assert alive and len(tokens) == 2
    assert after_stop == []
