"""The worker side of `TokenmillConnector` without vLLM: two `WorkerSide`s over real tcp agents,
caches shaped as vLLM's CPU backend lays them out (`[num_blocks, kv_heads, block_size, 2*head]`
per layer). A sealed request's blocks arrive byte for byte and its prefill side is released; a
corrupted or dropped pull, blocks sealed since by another request, or a different layout fail
(vLLM then recomputes); a release-only job is never reported received; an unacknowledged hold ends
at its timeout."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tests.serving.probes import wait
from tokenmill.engines.vllm.connector_jobs import LoadJob, SealJob, StepJobs, stamp
from tokenmill.engines.vllm.connector_worker import WorkerSide
from tokenmill.transfer import TcpBackend
from tokenmill.worker.transfer_faults import TransferFaults

NUM_BLOCKS, HEADS, BLOCK, HEAD = 8, 2, 32, 16
LAYERS = 3
HOLD_S = 30.0


class Side:
    def __init__(self, name: str, faults: str | None = None, hold_timeout_s: float = HOLD_S, layers: int = LAYERS):
        torch.manual_seed(len(name))
        self.caches = {f"model.layers.{i}.attn": torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
                       for i in range(layers)}
        self.worker = WorkerSide(name, [TcpBackend()], hold_timeout_s, pull_timeout_s=5.0,
                                 faults=TransferFaults.parse(faults))
        self.worker.register(self.caches)
        self.sent: set[str] = set()
        self.received: set[str] = set()
        self.failed: set[str] = set()

    def poll(self) -> None:
        sent, received, failed = self.worker.results()
        self.sent |= sent
        self.received |= received
        self.failed |= failed

    def blocks(self, ids: list[int]) -> list[torch.Tensor]:
        return [cache[ids] for cache in self.caches.values()]


@pytest.fixture
def sides() -> Iterator[Callable[..., Side]]:
    made: list[Side] = []

    def make(name: str, **kwargs) -> Side:
        made.append(Side(name, **kwargs))
        return made[-1]

    yield make
    for side in made:
        side.worker.close()


def hand_off(prefill: Side, request_id: str, block_ids: list[int]) -> dict:
    """The prefill side's end of a request: its blocks sealed, held, and the handle vLLM's scheduler side returns."""
    prefill.worker.seal(StepJobs(seals=[SealJob(request_id, block_ids)]))
    prefill.worker.start_loads(StepJobs(held=[request_id]))
    return {"agent": prefill.worker.agent.metadata(), "layout": prefill.worker.layout,
            "remote_request_id": request_id, "block_ids": block_ids, "num_tokens": len(block_ids) * BLOCK - 5,
            "stamp": stamp(request_id)}


def pull(decode: Side, prefill: Side, handle: dict, local: list[int], first_block: int = 0) -> None:
    decode.worker.start_loads(StepJobs(loads=[LoadJob("decode-req", handle, first_block, local)]))
    wait(lambda: (decode.poll(), "decode-req" in decode.received)[1], "the pull to end")
    wait(lambda: (prefill.poll(), handle["remote_request_id"] in prefill.sent)[1], "the prefill side's release")


def test_a_pull_copies_every_layer_byte_for_byte_and_releases_the_prefill_side(sides) -> None:
    prefill, decode = sides("prefill"), sides("decode")
    handle = hand_off(prefill, "req-1", [1, 2, 5])
    pull(decode, prefill, handle, [3, 4, 6])
    assert decode.failed == set()
    for got, sent in zip(decode.blocks([3, 4, 6]), prefill.blocks([1, 2, 5])):
        assert torch.equal(got, sent)
    # from first_block on only: the local prefix-cache hit (block 7 here) is left as it was
    before = decode.blocks([7])
    handle = hand_off(prefill, "req-2", [1, 2, 5])
    decode.received.clear()
    pull(decode, prefill, handle, [4, 6], first_block=1)
    assert decode.failed == set() and all(torch.equal(a, b) for a, b in zip(decode.blocks([7]), before))


@pytest.mark.parametrize("fault", ["corrupt", "drop"])
def test_a_corrupted_or_dropped_pull_fails_and_still_releases(sides, fault: str) -> None:
    prefill, decode = sides("prefill"), sides("decode", faults=fault)
    pull(decode, prefill, hand_off(prefill, "req-1", [1, 2]), [3, 4])
    assert decode.failed == {"decode-req"}  # and in received too: vLLM takes failed receives from both


def test_blocks_sealed_since_by_another_request_fail_the_pull(sides) -> None:
    prefill, decode = sides("prefill"), sides("decode")
    handle = hand_off(prefill, "req-1", [1, 2])
    prefill.worker.seal(StepJobs(seals=[SealJob("req-9", [2])]))  # its hold ended and block 2 was reused
    pull(decode, prefill, handle, [3, 4])
    assert decode.failed == {"decode-req"}


def test_a_different_layout_fails_the_pull_before_any_byte_moves(sides) -> None:
    prefill, decode = sides("prefill", layers=LAYERS + 1), sides("decode")
    before = decode.blocks([3, 4])
    pull(decode, prefill, hand_off(prefill, "req-1", [1, 2]), [3, 4])
    assert decode.failed == {"decode-req"}
    assert all(torch.equal(a, b) for a, b in zip(decode.blocks([3, 4]), before))


def test_a_release_only_job_is_not_reported_received(sides) -> None:
    prefill, decode = sides("prefill"), sides("decode")
    handle = hand_off(prefill, "req-1", [1, 2])
    decode.worker.start_loads(StepJobs(loads=[LoadJob("decode-req", handle, 0, [])]))
    wait(lambda: (prefill.poll(), "req-1" in prefill.sent)[1], "the prefill side's release")
    decode.poll()
    assert decode.received == set() and decode.failed == set()


def test_an_unacknowledged_hold_ends_at_its_timeout(sides) -> None:
    prefill = sides("prefill", hold_timeout_s=0.3)
    hand_off(prefill, "req-1", [1, 2])
    prefill.poll()
    assert prefill.sent == set()
    wait(lambda: (prefill.poll(), "req-1" in prefill.sent)[1], "the hold timeout", 5)


def test_a_prefill_side_gone_during_the_pull_fails_it(sides) -> None:
    prefill, decode = sides("prefill"), sides("decode", faults="delay=0.5")
    handle = hand_off(prefill, "req-1", [1, 2])
    decode.worker.start_loads(StepJobs(loads=[LoadJob("decode-req", handle, 0, [3, 4])]))
    prefill.worker.close()  # its process died while the decode side waited to pull
    wait(lambda: (decode.poll(), "decode-req" in decode.received)[1], "the pull to end")
    assert decode.failed == {"decode-req"}


def test_an_abort_after_the_handoff_releases_the_prefill_side_at_once(sides) -> None:
    """The worker server's side (`VLLMHandoff`): the handle from the last prefill output is passed
    on, and the frontend's abort (its client left before a decode worker pulled) frees the blocks."""
    import asyncio
    from types import SimpleNamespace

    from tokenmill.engines.vllm.handoff import VLLMHandoff

    prefill = sides("prefill")
    handle = hand_off(prefill, "vllm-req-1", [1, 2])

    async def scenario() -> dict | None:
        handoff = VLLMHandoff("prefill-0", hold_timeout_s=HOLD_S)
        await handoff.start(SimpleNamespace(take_handle=lambda request_id: handle if request_id == "req-1" else None))
        try:
            passed_on = await handoff.handle_for(SimpleNamespace(request_id="req-1"))
            assert await handoff.handle_for(SimpleNamespace(request_id="req-2")) is None  # vLLM held nothing
            await handoff.release("req-1", "aborted")
            return passed_on
        finally:
            await handoff.close()

    assert asyncio.run(scenario()) == handle
    wait(lambda: (prefill.poll(), "vllm-req-1" in prefill.sent)[1], "the release")
