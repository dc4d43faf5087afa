"""Conditional disaggregation: where each prompt is prefilled, and why."""
from __future__ import annotations

import pytest

from tokenmill.router.disagg import LOCAL, REMOTE, DisaggConfig, DisaggPolicy


def decide(config: DisaggConfig, uncached: int, queues: list[int], local: int = 0) -> tuple[str, str]:
    choice = DisaggPolicy(config).decide(uncached, 0, queues, local)
    return choice.decision, choice.reason


def test_long_prompts_go_remote_and_short_or_cached_ones_stay() -> None:
    config = DisaggConfig(threshold_tokens=256, queue_limit=2)
    assert decide(config, 1000, [0, 1]) == (REMOTE, "long_uncached_prompt")
    assert decide(config, 255, [0, 1]) == (LOCAL, "short_uncached_prompt")
    assert decide(config, 1000, []) == (LOCAL, "no_prefill_worker")
    policy = DisaggPolicy(config)
    assert policy.decide(1000, 800, [0]).reason == "short_uncached_prompt"  # the decode worker caches 800


def test_a_full_prefill_pool_sends_prompts_to_a_decode_worker_only_up_to_its_local_limit() -> None:
    """Every prefill worker is at the queue limit: the decode worker takes the prompt while it
    prefills fewer than `local_limit` of its own; past that the prompt queues remotely, since a
    second local prefill would stall the decode worker's streams once more."""
    config = DisaggConfig(threshold_tokens=256, queue_limit=2, local_limit=1)
    assert decide(config, 1000, [2, 3], local=0) == (LOCAL, "prefill_queue_full")
    assert decide(config, 1000, [2, 3], local=1) == (REMOTE, "decode_worker_busy")
    assert decide(config, 1000, [1, 3], local=1) == (REMOTE, "long_uncached_prompt")  # one queue has room
    assert decide(config, 100, [2, 3], local=5) == (LOCAL, "short_uncached_prompt")  # short ones always stay
    never = DisaggConfig(threshold_tokens=256, queue_limit=2, local_limit=0)
    assert decide(never, 1000, [2, 2], local=0) == (REMOTE, "decode_worker_busy")
    wider = DisaggConfig(threshold_tokens=256, queue_limit=2, local_limit=3)
    assert [decide(wider, 1000, [2], local=n)[0] for n in range(5)] == [LOCAL, LOCAL, LOCAL, REMOTE, REMOTE]


def test_decisions_are_counted_by_reason() -> None:
    policy = DisaggPolicy(DisaggConfig(threshold_tokens=10, queue_limit=1, local_limit=1))
    policy.decide(100, 0, [1], 0)
    policy.decide(100, 0, [1], 1)
    policy.decide(100, 0, [1], 1)
    snapshot = policy.metrics_snapshot()
    assert snapshot['tokenmill_disagg_decisions_total{decision="local",reason="prefill_queue_full"}'] == 1.0
    assert snapshot['tokenmill_disagg_decisions_total{decision="remote",reason="decode_worker_busy"}'] == 2.0


@pytest.mark.parametrize("field,value,flag", [("threshold_tokens", -1, "--disagg-threshold"),
                                              ("queue_limit", 0, "--prefill-queue-limit"),
                                              ("local_limit", -1, "--local-prefill-limit")])
def test_bad_settings_name_their_flag(field: str, value: int, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        DisaggConfig(**{field: value})
