"""Workers' KV transfer between two real engines in one process, over shm and over tcp.

The prefill engine's pool is in shared memory and registered with its agent; the decode engine
pulls through `KVTransferService.pull`, verifies per-block checksums, and acknowledges. Faults
(corruption, a dropped connection, a bad handle, no acknowledgement) must all end in a correct
answer, recomputed, with every block back in its pool.
"""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from tests.engine.helpers import GREEDY, make_engine, prompts
from tokenmill.engine.async_engine import AsyncLLMEngine, KVImport
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.textgen.outputs import FINISH_HANDOFF, RequestOutput
from tokenmill.worker.kv_transfer import KVTransferService
from tokenmill.worker.transfer_faults import TransferFaults

PARAMS = dataclasses.replace(GREEDY, max_tokens=16)


def service_engine(model: Path, name: str, backends: tuple[str, ...], **kwargs) -> tuple[KVTransferService, AsyncLLMEngine]:
    service = KVTransferService(name, backends, **kwargs)
    engine = LLMEngine(make_engine(model, num_kv_blocks=96).config, kv_allocator=service.allocate)
    return service, AsyncLLMEngine(engine)


async def collect(stream) -> list[RequestOutput]:
    return [out async for out in stream]


async def disaggregated(model: Path, prompt_list: list[list[int]], backends: tuple[str, ...],
                        faults: TransferFaults | None = None, mangle=None, hold_timeout_s: float = 30.0):
    pre_svc, pre = service_engine(model, "pre", backends, hold_timeout_s=hold_timeout_s)
    dec_svc, dec = service_engine(model, "dec", backends, faults=faults)
    for svc, engine in ((pre_svc, pre), (dec_svc, dec)):
        await engine.start()
        await svc.start(engine)
    try:
        outputs = []
        for i, prompt in enumerate(prompt_list):
            first = (await collect(pre.generate(f"r{i}", prompt, PARAMS, prefill_only=True)))[-1]
            assert first.finish_reason == FINISH_HANDOFF
            handle = await pre_svc.handle_for(first)
            if mangle is not None:
                handle = mangle(handle)
            rest = await collect(dec.generate(
                f"r{i}", prompt + first.new_token_ids, dataclasses.replace(PARAMS, max_tokens=PARAMS.max_tokens - 1),
                output_offset=1, kv_import=KVImport(lambda plan, h=handle: dec_svc.pull(h, plan))))
            outputs.append(first.new_token_ids + [t for o in rest for t in o.new_token_ids])
        for _ in range(100):  # acknowledgements are asynchronous
            if (await pre.stats()).num_held == 0:
                break
            await asyncio.sleep(0.05)
        stats = {"pre": await pre.stats(), "dec": await dec.stats()}
        return outputs, stats, pre_svc.counters, dec_svc.counters
    finally:
        for svc, engine in ((pre_svc, pre), (dec_svc, dec)):
            await svc.close()
            await engine.stop()


@pytest.fixture(scope="module")
def workload(tiny_dense: Path) -> tuple[list[list[int]], list[list[int]]]:
    ref = make_engine(tiny_dense, num_kv_blocks=96)
    prompt_list = prompts(ref, 4, seed=21, low=10, high=140)
    return prompt_list, [ref.generate([p], PARAMS)[0] for p in prompt_list]


def assert_clean(stats) -> None:
    for s in stats.values():
        assert s.num_held == s.num_importing == s.num_running == s.num_waiting == 0
        assert s.num_free_blocks == s.num_blocks


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_pulled_kv_decodes_exactly(tiny_dense: Path, workload, backend: str) -> None:
    prompt_list, expected = workload
    outputs, stats, pre_c, dec_c = asyncio.run(disaggregated(tiny_dense, prompt_list, (backend,)))
    assert outputs == expected
    assert dec_c.pulls == len(prompt_list) and dec_c.pull_failures == 0 and dec_c.bytes > 0
    assert stats["dec"].prefill_tokens == 0  # every prompt's KV came over the wire
    assert pre_c.released_by_ack == len(prompt_list)
    assert_clean(stats)


@pytest.mark.parametrize("backend,faults", [("shm", "corrupt"), ("tcp", "corrupt"), ("tcp", "drop")])
def test_faulty_transfer_is_recomputed(tiny_dense: Path, workload, backend: str, faults: str) -> None:
    prompt_list, expected = workload
    outputs, stats, pre_c, dec_c = asyncio.run(
        disaggregated(tiny_dense, prompt_list, (backend,), TransferFaults.parse(faults)))
    assert outputs == expected
    assert dec_c.pulls == len(prompt_list)
    if faults == "corrupt":
        assert dec_c.failure_reasons == {"checksum": len(prompt_list)}
    else:  # a drop that lands after the last byte is already buffered cannot fail that pull
        assert dec_c.failure_reasons.get("transfer", 0) >= 1
    recomputed = sum(len(p) for p in prompt_list[:dec_c.pull_failures])
    assert stats["dec"].prefill_tokens >= recomputed  # recomputed, not decoded from
    assert pre_c.released_by_ack == len(prompt_list)  # a failed pull still releases the prefill's blocks
    assert_clean(stats)


def test_bad_handle_is_recomputed(tiny_dense: Path, workload) -> None:
    prompt_list, expected = workload

    def truncate(handle: dict) -> dict:
        return {**handle, "block_ids": handle["block_ids"][:-1]}

    outputs, stats, _, dec_c = asyncio.run(disaggregated(tiny_dense, prompt_list[:2], ("shm",), mangle=truncate))
    assert outputs == expected[:2]
    assert dec_c.failure_reasons == {"bad handle": 2}
    assert_clean(stats)


def test_unacknowledged_hold_times_out(tiny_dense: Path, workload) -> None:
    prompt_list, _ = workload

    async def scenario() -> tuple[int, int]:
        svc, engine = service_engine(tiny_dense, "pre", ("shm",), hold_timeout_s=0.2)
        await engine.start()
        await svc.start(engine)
        try:
            await collect(engine.generate("lonely", prompt_list[0], PARAMS, prefill_only=True))
            held = (await engine.stats()).num_held
            for _ in range(60):
                if svc.counters.released_by_timeout:
                    break
                await asyncio.sleep(0.05)
            stats = await engine.stats()
            return held, stats.num_held + stats.num_blocks - stats.num_free_blocks
        finally:
            await svc.close()
            await engine.stop()

    held, left = asyncio.run(scenario())
    assert held == 1 and left == 0


def test_no_room_to_land_the_kv_releases_the_prefill_at_once(tiny_dense: Path) -> None:
    """A decode pool too full for the prompt's blocks recomputes it locally and tells the prefill
    worker so: its blocks are freed on that acknowledgement, not held until the timeout."""
    async def scenario():
        pre_svc, pre = service_engine(tiny_dense, "pre", ("shm",), hold_timeout_s=30.0)
        dec_svc = KVTransferService("dec", ("shm",))
        dec = AsyncLLMEngine(LLMEngine(make_engine(tiny_dense, num_kv_blocks=8).config,
                                       kv_allocator=dec_svc.allocate))
        holder, prompt = prompts(dec.engine, 2, seed=9, low=100, high=101)
        for svc, engine in ((pre_svc, pre), (dec_svc, dec)):
            await engine.start()
            await svc.start(engine)
        try:
            await collect(dec.generate("holder", holder, PARAMS, prefill_only=True))  # 7 of the 8 blocks, held
            first = (await collect(pre.generate("big", prompt, PARAMS, prefill_only=True)))[-1]
            handle = await pre_svc.handle_for(first)
            decoding = asyncio.create_task(collect(dec.generate(
                "big", prompt + first.new_token_ids, dataclasses.replace(PARAMS, max_tokens=PARAMS.max_tokens - 1),
                output_offset=1, kv_import=KVImport(lambda plan: dec_svc.pull(handle, plan),
                                                    lambda: dec_svc.decline(handle)))))
            for _ in range(200):  # declined, then acknowledged (asynchronously) while the pool is still full
                if dec_svc.counters.declined and (await pre.stats()).num_held == 0:
                    break
                await asyncio.sleep(0.05)
            released_while_full = (await pre.stats()).num_held == 0
            assert await dec.release_held("holder")  # room now: the local recompute can run
            rest = await decoding
            output = first.new_token_ids + [t for o in rest for t in o.new_token_ids]
            stats = {"pre": await pre.stats(), "dec": await dec.stats()}
            return output, prompt, released_while_full, stats, pre_svc.counters, dec_svc.counters
        finally:
            for svc, engine in ((pre_svc, pre), (dec_svc, dec)):
                await svc.close()
                await engine.stop()

    output, prompt, released_while_full, stats, pre_c, dec_c = asyncio.run(scenario())
    assert output == make_engine(tiny_dense, num_kv_blocks=96).generate([prompt], PARAMS)[0]
    assert dec_c.declined == 1 and dec_c.pulls == 0 and stats["dec"].prefill_tokens >= len(prompt)
    assert released_while_full and pre_c.released_by_ack == 1 and pre_c.released_by_timeout == 0
    assert_clean(stats)


def test_fault_spec_is_validated() -> None:
    assert TransferFaults.parse("corrupt,delay=0.5") == TransferFaults(corrupt_every=1, delay_s=0.5)
    faults = TransferFaults.parse("corrupt=3,drop=2")
    assert [n for n in range(1, 10) if faults.corrupts(n)] == [3, 6, 9]
    assert [n for n in range(1, 7) if faults.drops(n)] == [2, 4, 6]
    for bad in ("explode", "delay", "delay=soon", "corrupt=0", "corrupt=x", "drop=-1", "drop=1.5"):
        with pytest.raises(ValueError, match="--transfer-faults"):
            TransferFaults.parse(bad)
