"""The scheduler side of `TokenmillConnector` without vLLM, on requests shaped as vLLM's: a prompt
prefilled in chunks is sealed once, at its last chunk; only a prefill that made its one token
hands off; a decode loads the blocks beyond its local hits, once."""
from __future__ import annotations

from types import SimpleNamespace

from tokenmill.engines.vllm.connector_jobs import LoadJob, SealJob, stamp
from tokenmill.engines.vllm.connector_scheduler import REMOTE_DECODE, REMOTE_PREFILL, SchedulerSide

BLOCK = 32
AGENT = {"name": "prefill-agent"}


def request(request_id: str, prompt_tokens: int, params: dict | None, computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, num_prompt_tokens=prompt_tokens, kv_transfer_params=params,
                           num_computed_tokens=computed)


def test_a_chunked_prefill_is_sealed_at_its_last_chunk_only() -> None:
    side = SchedulerSide(BLOCK)
    prefill = request("p-1", 100, {REMOTE_DECODE: True})
    side.on_new_request(prefill)
    side.on_new_request(request("other", 50, None))
    blocks = {"p-1": [7, 8, 9, 10, 11], "other": [1, 2]}.__getitem__
    assert side.step_jobs({"p-1": 64, "other": 50}, blocks).seals == []  # 64 of 100 tokens
    prefill.num_computed_tokens = 64
    assert side.step_jobs({"p-1": 36}, blocks).seals == [SealJob("p-1", [7, 8, 9, 10])]  # the prompt's 4 blocks
    assert side.step_jobs({}, blocks).seals == []


def test_only_a_prefill_that_made_its_one_token_hands_off() -> None:
    side = SchedulerSide(BLOCK)
    for request_id in ("early", "stopped", "done"):
        side.on_new_request(request(request_id, 100, {REMOTE_DECODE: True}))
    assert side.finished(request("early", 100, None), [7, 8], True) == (False, None)  # no agent announced yet
    side.handshake(AGENT, {"engine": "vllm"})
    assert side.finished(request("stopped", 100, None), [7, 8], False) == (False, None)  # ended by a stop
    hold, handle = side.finished(request("done", 100, None), [7, 8, 9, 10], True)
    assert hold and handle == {"agent": AGENT, "layout": {"engine": "vllm"}, "remote_request_id": "done",
                               "block_ids": [7, 8, 9, 10], "num_tokens": 100, "stamp": stamp("done")}
    assert side.step_jobs({}, lambda _: []).held == ["done"]
    assert side.finished(request("plain", 100, None), [1], True) == (False, None)  # never a prefill request


def test_a_decode_loads_the_blocks_beyond_its_local_hits_once() -> None:
    side = SchedulerSide(BLOCK)
    handle = {"agent": AGENT, "num_tokens": 100, "block_ids": [7, 8, 9, 10]}
    decode = request("d-1", 101, {**handle, REMOTE_PREFILL: True})
    assert side.matched_tokens(decode, 32) == (68, True)  # one block was a local prefix hit
    side.after_alloc(decode, [20, 21, 22, 23], 68)
    [job] = side.step_jobs({}, lambda _: []).loads
    assert (job.request_id, job.first_block, job.block_ids) == ("d-1", 1, [21, 22, 23])
    assert side.matched_tokens(decode, 0) == (0, False)  # a failed pull is recomputed, never pulled again
    side.after_alloc(decode, [20, 21, 22, 23], 0)
    assert side.step_jobs({}, lambda _: []).loads == []
    # every prompt block already local: nothing to pull, only the prefill side's copy to release
    whole = request("d-2", 101, {**handle, REMOTE_PREFILL: True})
    assert side.matched_tokens(whole, 128) == (0, False)
    side.after_alloc(whole, [30, 31, 32, 33], 0)
    assert side.step_jobs({}, lambda _: []).loads == [LoadJob("d-2", whole.kv_transfer_params, 0, [])]
