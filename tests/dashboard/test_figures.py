"""The dashboard's figures over a window, by hand: latency quantiles from the histogram buckets,
tokens streamed, prefix hits split by tier (a restarted worker counting from zero), and the same
figures whether the samples come from the registry or from the `/metrics` text."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.api.dashboard.figures import snapshot, window
from tokenmill.api.metrics import FrontendMetrics


def _worker(name: str, **values: float) -> dict[str, float]:
    return {f'tokenmill_worker_{key}{{worker="{name}"}}': value for key, value in values.items()}


def _tier_hits(worker: str, tier: str, blocks: float) -> dict[str, float]:
    return {f'tokenmill_worker_kv_tier_hits{{tier="{tier}",worker="{worker}"}}': blocks}


def test_window_figures_by_hand() -> None:
    backend = {**_worker("w0", queried_tokens=0, device_hit_tokens=0, onboarded_tokens=0, prefill_tokens=0),
               **_worker("w1", queried_tokens=500, device_hit_tokens=100, onboarded_tokens=0, prefill_tokens=400),
               **_tier_hits("w0", "host", 0), **_tier_hits("w0", "disk", 0)}
    metrics = FrontendMetrics(lambda: dict(backend))
    before = snapshot(metrics.registry.collect(), 100.0)
    for _ in range(10):  # ten first tokens at 20 ms, in the (10 ms, 25 ms] bucket
        metrics.ttft.observe(0.02)
    for _ in range(30):  # thirty later tokens at 3 ms, in the (2.5 ms, 5 ms] bucket
        metrics.itl.observe(0.003)
    metrics.generated_tokens.inc(40)
    backend.update({**_worker("w0", queried_tokens=1000, device_hit_tokens=600, onboarded_tokens=240,
                              prefill_tokens=160, num_running=3, num_waiting=2),
                    **_worker("w1", queried_tokens=200, device_hit_tokens=0, onboarded_tokens=0, prefill_tokens=200,
                              num_running=1, num_waiting=0),  # restarted: counts from zero
                    **_tier_hits("w0", "host", 10), **_tier_hits("w0", "disk", 5),
                    'tokenmill_workers_by_state{role="agg",state="serving"}': 2.0})
    after = snapshot(metrics.registry.collect(), 105.0)
    figures = window(before, after, block_size=16)
    assert figures["window_s"] == 5.0
    assert figures["ttft_p50_s"] == pytest.approx(0.01 + 0.015 * 0.5)
    assert figures["ttft_p90_s"] == pytest.approx(0.01 + 0.015 * 0.9)
    assert figures["itl_p50_s"] == pytest.approx(0.0025 + 0.0025 * 0.5)
    assert figures["output_tokens"] == 40 and figures["output_tokens_per_s"] == pytest.approx(8.0)
    assert (figures["in_flight"], figures["queued"]) == (4.0, 2.0)
    assert figures["prompt_tokens_looked_up"] == 1200  # 1000 on w0 and 200 on the restarted w1
    assert figures["hit_rate"] == pytest.approx({"device": 600 / 1200, "host": 160 / 1200, "disk": 80 / 1200,
                                                 "shared": 0.0})
    assert figures["prefill_computed_per_s"] == pytest.approx((160 + 200) / 5)
    assert figures["prefill_reused_per_s"] == pytest.approx((600 + 240) / 5)
    assert figures["cost_per_million_tokens"] is None  # no price configured
    assert figures["workers"] == {"agg": {"serving": 2}}


def test_nothing_measured_is_none_not_zero() -> None:
    metrics = FrontendMetrics(dict)
    before, after = snapshot(metrics.registry.collect(), 0.0), snapshot(metrics.registry.collect(), 1.0)
    figures = window(before, after, 16)
    assert figures["ttft_p50_s"] is None and figures["itl_p90_s"] is None and figures["hit_rate"] is None
    assert figures["output_tokens_per_s"] == 0.0 and figures["workers"] == {}


def test_the_registry_and_the_metrics_text_give_the_same_figures() -> None:
    backend = {**_worker("w0", queried_tokens=0, device_hit_tokens=0), **_tier_hits("w0", "host", 0)}
    metrics = FrontendMetrics(lambda: dict(backend), usd_per_worker_hour=2.0)

    def both(t: float):
        text = generate_latest(metrics.registry).decode()
        return snapshot(metrics.registry.collect(), t), snapshot(text_string_to_metric_families(text), t)

    first = both(0.0)
    timer = metrics.start_request(100)
    timer.on_tokens(1)
    timer.on_tokens(3)
    timer.on_finish("success", 100, 4, 0)
    backend.update({**_worker("w0", queried_tokens=100, device_hit_tokens=32, num_running=0),
                    **_tier_hits("w0", "host", 2)})
    second = both(2.0)
    from_registry, from_text = window(first[0], second[0], 16), window(first[1], second[1], 16)
    assert from_registry == from_text
    assert from_text["output_tokens"] == 4 and from_text["hit_rate"]["host"] == pytest.approx(32 / 100)
    assert from_text["cost_per_million_tokens"] is not None
