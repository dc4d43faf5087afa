"""Attention data parallelism with wide EP (`--ep 2 --attention-dp 2`): each rank schedules its
own requests on its own KV pool, requests go where their prefix is cached, the ranks' pools are
announced as one worker's, and the text is the single-process engine's."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.helpers import GREEDY, make_engine, prompts
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.kv.events import BlockRemoved, BlockStored, KVEvent, KVEventEmitter
from tokenmill.kv.union_events import UnionEvents
from tokenmill.textgen.sampling import SamplingParams


def _run(engine: LLMEngine, requests: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_ranks_schedule_their_own_requests_and_prefixes_find_their_rank(tiny_moe: Path) -> None:
    single = make_engine(tiny_moe)
    dp = make_engine(tiny_moe, ep=2, attention_dp=2)
    try:
        assert len(dp.schedulers) == 2 and dp.stats().num_blocks == 2 * single.stats().num_blocks
        first = dict(zip("abcd", prompts(single, 4, seed=11, low=60, high=61)))  # 4 blocks each
        for rid, prompt in first.items():
            dp.add_request(rid, prompt, GREEDY)
        assert [dp.requests[rid].dp_rank for rid in "abcd"] == [0, 1, 0, 1]  # the less loaded rank
        assert dp.stats().num_waiting == 4
        for rid in "abcd":
            dp.abort(rid)
        assert _run(dp, first) == _run(single, first)
        # a new turn on "b" (rank 1) goes to rank 1, where its prefix is cached, though both are idle
        turn = first["b"] + [7, 8, 9]
        dp.add_request("b2", turn, GREEDY)
        assert dp.requests["b2"].dp_rank == 1
        # ... but not once rank 1 is busier by more than the prefix saves (3 blocks)
        longs = prompts(single, 2, seed=13, low=150, high=151)  # 10 blocks each
        dp.add_request("long", longs[0], GREEDY)
        dp.add_request("long2", longs[1], GREEDY)
        assert [dp.requests[r].dp_rank for r in ("long", "long2")] == [0, 1]  # rank 1: 4 + 10 blocks
        dp.add_request("b3", turn, GREEDY)
        assert dp.requests["b3"].dp_rank == 0  # 4 to compute + 10 held, against 1 + 14
        for rid in ("b2", "long", "long2", "b3"):
            dp.abort(rid)
        out = _run(dp, {"b2": turn})
        assert out == _run(single, {"b2": turn})
        assert dp.stats().device_hit_tokens > 0
        assert all(pool.num_free_blocks == pool.num_blocks for pool in dp.pools)  # nothing leaked
    finally:
        dp.close()


def test_one_rank_idle_while_the_other_decodes_and_sampling_matches(tiny_moe: Path) -> None:
    """One request: rank 1 has nothing all along and joins every step with zero tokens; seeded
    sampling gives the single engine's tokens."""
    single = make_engine(tiny_moe)
    dp = make_engine(tiny_moe, ep=2, attention_dp=2)
    try:
        params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
        prompt = {"x": prompts(single, 1, seed=12)[0]}
        assert _run(dp, prompt, params) == _run(single, prompt, params)
    finally:
        dp.close()


def test_a_disaggregated_handoff_is_refused_with_attention_dp(tiny_moe: Path) -> None:
    dp = make_engine(tiny_moe, ep=2, attention_dp=2)
    try:
        with pytest.raises(ValueError, match="--attention-dp"):
            dp.add_request("p", [5, 6, 7], GREEDY, prefill_only=True)
        with pytest.raises(ValueError, match="--attention-dp"):
            dp.begin_import("q", [5, 6, 7, 8], GREEDY)
        assert not dp.has_unfinished()
    finally:
        dp.close()


def test_pools_are_announced_as_one_worker() -> None:
    """A hash is removed from the worker's view only when no pool holds it any more."""
    emitter = KVEventEmitter("w")
    seen: list[KVEvent] = []
    emitter.subscribe(seen.append)
    union = UnionEvents(emitter)
    zero, one = union.view(0), union.view(1)
    zero.stored("device", None, [1, 2, 3])
    one.stored("device", None, [1, 2])
    zero.removed("device", [2, 3])
    assert [type(e) for e in seen] == [BlockStored, BlockStored, BlockRemoved]
    assert seen[-1].hashes == (3,)  # 2 is still on pool 1
    one.cleared()
    assert isinstance(seen[-1], BlockRemoved) and sorted(seen[-1].hashes) == [2]  # 1 is still on pool 0
    zero.cleared()
    assert seen[-1].hashes == (1,) and [e.event_id for e in seen] == list(range(len(seen)))
