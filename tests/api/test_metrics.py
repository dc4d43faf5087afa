"""The metrics module on its own: snapshot keys, the output-token rate, the cost gauge."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.api.metrics import FrontendMetrics, OutputTokenRate, parse_series


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("key", "expected"), [
    ("tokenmill_workers", ("tokenmill_workers", {})),
    ("worker_kv_usage", ("tokenmill_worker_kv_usage", {})),
    ('tokenmill_worker_kv_usage{worker="w0"}', ("tokenmill_worker_kv_usage", {"worker": "w0"})),
    ('x{a="1", b="two"}', ("tokenmill_x", {"a": "1", "b": "two"})),
    ("bad{", None), ("1abc", None), ('x{a=1}', None),
])
def test_parse_series(key: str, expected: tuple[str, dict[str, str]] | None) -> None:
    assert parse_series(key) == expected


def test_output_rate_is_tokens_over_the_window() -> None:
    clock = FakeClock()
    rate = OutputTokenRate(window_s=10.0, clock=clock)
    assert rate.per_second() == 0.0
    rate.add(50)
    clock.now += 5.0
    rate.add(50)
    assert rate.per_second() == pytest.approx(100 / 5.0)  # younger than the window: since the first token
    clock.now += 20.0
    assert rate.per_second() == 0.0  # everything aged out


def _samples(metrics: FrontendMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_backend_gauges_and_cost_per_million_tokens() -> None:
    snapshot = {"tokenmill_workers": 2.0, 'tokenmill_worker_kv_usage{worker="a"}': 0.5,
                'tokenmill_worker_kv_usage{worker="b"}': 0.25, "nonsense{": 1.0}
    metrics = FrontendMetrics(lambda: snapshot, usd_per_worker_hour=3.6)
    clock = FakeClock()
    metrics.output_rate.clock = clock
    metrics.output_rate.add(1000)
    clock.now += 10.0  # 100 tokens/s = 360,000 tokens/hour for 2 workers at $3.6/hour each
    samples = _samples(metrics)
    assert samples[("tokenmill_worker_kv_usage", (("worker", "a"),))] == 0.5
    assert samples[("tokenmill_worker_kv_usage", (("worker", "b"),))] == 0.25
    assert samples[("tokenmill_cost_per_million_tokens", ())] == pytest.approx(7.2 / 360_000 * 1e6)


def test_request_timer_feeds_histograms_and_counters() -> None:
    metrics = FrontendMetrics(dict, usd_per_worker_hour=None)
    timer = metrics.start_request()
    timer.on_tokens(1)
    timer.on_tokens(2)
    timer.on_finish("success", prompt_tokens=7, output_tokens=3, cached_tokens=4)
    samples = _samples(metrics)
    assert samples[("tokenmill_time_to_first_token_seconds_count", ())] == 1
    assert samples[("tokenmill_inter_token_latency_seconds_count", ())] == 2
    assert samples[("tokenmill_e2e_request_latency_seconds_count", ())] == 1
    assert (samples[("tokenmill_input_tokens_total", ())], samples[("tokenmill_output_tokens_total", ())],
            samples[("tokenmill_cached_tokens_total", ())]) == (7, 3, 4)
    assert samples[("tokenmill_requests_total", (("status", "success"),))] == 1
    assert ("tokenmill_cost_per_million_tokens", ()) not in samples  # no price configured
