"""Load tracking (charges, releases, corrections) and the approximate index (TTL, size cap)."""
from __future__ import annotations

import pytest

from tokenmill.router.approx import ApproxIndexer
from tokenmill.router.load import LoadTracker, WorkerLoad


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_prefill_is_charged_until_first_token_and_decode_from_then_until_finish() -> None:
    load = LoadTracker(block_size=16)
    load.add_worker("w")
    load.on_routed("r1", "w", prefill_blocks=6, decode_blocks=8)
    load.on_routed("r2", "w", prefill_blocks=2, decode_blocks=3)
    assert load.load("w") == WorkerLoad(8, 0)  # as the worker counts: prefilling requests are prefill only
    load.on_first_token("r1")
    load.on_first_token("r1")              # repeated: no double release
    assert load.load("w") == WorkerLoad(2, 8)
    load.on_finished("r2")                 # finished before its first token (an abort)
    assert load.load("w") == WorkerLoad(0, 8)
    load.on_finished("r1")
    load.on_finished("unknown")
    assert load.load("w") == WorkerLoad(0, 0) and load.num_requests() == 0


def test_the_decode_charge_follows_the_request_length_as_the_worker_counts_it() -> None:
    load = LoadTracker(block_size=16)
    load.add_worker("w")
    load.on_routed("r", "w", prefill_blocks=4, decode_blocks=4)
    load.on_progress("r", num_tokens=64 + 1, num_cached_tokens=32)   # first token: 5 blocks, 2 cached
    assert load.load("w") == WorkerLoad(0, 3)
    load.on_progress("r", num_tokens=64 + 17, num_cached_tokens=32)  # 17 tokens out: one block more
    assert load.load("w") == WorkerLoad(0, 4)
    load.on_finished("r")
    assert load.load("w") == WorkerLoad(0, 0)


def test_reports_add_other_frontends_load_and_never_hide_routed_load() -> None:
    load = LoadTracker()
    load.add_worker("w")
    load.on_routed("burst", "w", 4, 10)    # routed after the worker measured: not in its report
    load.set_external("w", prefill_blocks=0, decode_blocks=3)  # other frontends' requests there
    assert load.load("w") == WorkerLoad(4, 3) and load.tracked("w") == WorkerLoad(4, 0)
    load.on_finished("burst")
    assert load.load("w") == WorkerLoad(0, 3)
    load.set_external("w", 0, 0)
    assert load.load("w") == WorkerLoad(0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        load.set_external("w", -1, 0)


def test_removing_a_worker_drops_its_requests() -> None:
    load = LoadTracker()
    load.add_worker("a")
    load.add_worker("b")
    load.on_routed("r", "a", 1, 1)
    load.remove_worker("a")
    assert load.worker_of("r") is None and load.load("a") == WorkerLoad()
    with pytest.raises(ValueError, match="unknown worker"):
        load.on_routed("r2", "a", 1, 1)
    load.on_routed("r3", "b", 1, 1)
    with pytest.raises(ValueError, match="already charged"):
        load.on_routed("r3", "b", 1, 1)
    with pytest.raises(ValueError, match=">= 0"):
        load.on_routed("r4", "b", -1, 1)


def test_approx_index_matches_recorded_prompts_until_their_ttl() -> None:
    clock = FakeClock()
    approx = ApproxIndexer(ttl_s=10.0, max_blocks=100, clock=clock)
    approx.record("a", [1, 2, 3])
    clock.now = 6.0
    approx.record("b", [1, 2])
    approx.record("a", [1])                # refreshes a's block 1 only
    assert approx.match([1, 2, 3, 4]) == {"a": {"device": 3}, "b": {"device": 2}}
    clock.now = 10.5                       # a's blocks 2 and 3 expired, block 1 was refreshed
    assert approx.match([1, 2, 3]) == {"a": {"device": 1}, "b": {"device": 2}}
    clock.now = 16.5
    assert approx.match([1, 2]) == {}
    assert approx.num_blocks() == 0


def test_approx_index_size_cap_forgets_the_oldest() -> None:
    approx = ApproxIndexer(ttl_s=100.0, max_blocks=4, clock=FakeClock())
    approx.record("a", [1, 2, 3])
    approx.record("b", [1, 2, 3])
    assert approx.num_blocks() == 4
    assert approx.match([1, 2, 3]) == {"b": {"device": 3}}   # a's 1 and 2 went first
    approx.remove_worker("b")
    assert approx.match([1, 2, 3]) == {} and approx.num_blocks() == 1
    with pytest.raises(ValueError, match="max_blocks"):
        ApproxIndexer(max_blocks=0)


def test_held_blocks_count_shared_prompt_blocks_once_and_say_what_would_not_fit() -> None:
    load = LoadTracker(block_size=16)
    load.add_worker("w")
    assert load.shortfall("w", [1, 2], 3) is None            # capacity unknown: no opinion
    load.set_capacity("w", 10)
    load.on_routed("a", "w", 3, 3, block_hashes=[1, 2], prompt_blocks=3)   # 2 full blocks + a partial one
    load.on_routed("b", "w", 1, 1, block_hashes=[1, 2], prompt_blocks=3)   # same prefix: shared
    assert load.held_blocks("w") == 2 + 1 + 1
    assert load.shortfall("w", [1, 2, 7], 4) == 0            # 4 held + 2 new = 6 <= 10
    assert load.shortfall("w", [8, 9, 10, 11, 12], 6) == 0   # 4 + 6 = 10: just fits
    assert load.shortfall("w", [8, 9, 10, 11, 12, 13], 7) == 1
    load.on_progress("a", num_tokens=3 * 16 + 16, num_cached_tokens=0)  # a grew to 4 blocks: 2 beyond its hashes
    assert load.held_blocks("w") == 2 + 2 + 1
    load.on_finished("a")
    load.on_finished("b")
    assert load.held_blocks("w") == 0 and load.shortfall("w", [1], 1) == 0
