"""The asyncio wrapper: concurrent streams, validation errors, and abort on cancellation."""
import asyncio
import time
from pathlib import Path

import pytest

from tests.engine.helpers import make_engine, prompts
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.textgen.sampling import SamplingParams


async def _collect(engine: AsyncLLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens = []
    async for out in engine.generate(rid, prompt, params):
        tokens += out.new_token_ids
    return tokens


def test_streams_match_the_synchronous_engine(tiny_moe: Path) -> None:
    sync = make_engine(tiny_moe)
    batch = prompts(sync, 6, seed=20)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = sync.generate(batch, params)

    async def main() -> list[list[int]]:
        engine = AsyncLLMEngine(make_engine(tiny_moe))
        await engine.start()
        try:
            return await asyncio.gather(*(_collect(engine, f"r{i}", p, params) for i, p in enumerate(batch)))
        finally:
            await engine.stop()

    assert asyncio.run(main()) == expected


def test_validation_error_reaches_the_caller_and_cancel_aborts(tiny_dense: Path) -> None:
    async def main() -> None:
        engine = AsyncLLMEngine(make_engine(tiny_dense))
        await engine.start()
        try:
            with pytest.raises(ValueError, match="prompt"):
                await _collect(engine, "bad", [], SamplingParams())
            first_token = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.generate("long", [5] * 20, SamplingParams(
                        max_tokens=100_000, temperature=0.0, ignore_eos=True)):
                    first_token.set()

            # cancelled once streaming has begun; 100k tokens cannot finish first on any machine
            task = asyncio.create_task(consume())
            await asyncio.wait_for(first_token.wait(), timeout=120)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 60  # the abort lands at the next engine step
            while time.monotonic() < deadline:
                stats = await engine.stats()
                if stats.num_running == 0 and stats.kv_usage == 0.0:
                    break
                await asyncio.sleep(0.05)
            assert stats.num_running == 0 and stats.kv_usage == 0.0
        finally:
            await engine.stop()

    asyncio.run(main())
