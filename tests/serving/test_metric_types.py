"""/metrics read by Prometheus' own text parser: the router's and the workers' re-exported series
have their true types (counters, histograms with ordered cumulative buckets, gauges)."""
from __future__ import annotations

import math
import random

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.serving.conftest import Server
from tests.serving.probes import metric, wait
from tokenmill.api.metric_families import typed_families


def test_the_served_metrics_have_their_true_types(two_worker_server: Server) -> None:
    for i in range(3):
        body = {"model": "tiny", "prompt": [5, 6, 7, 8 + i], "max_tokens": 2}
        assert httpx.post(two_worker_server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    # each worker's steps' time from its start, once a heartbeat after its steps has come
    wait(lambda: metric(two_worker_server.url, "tokenmill_worker_busy_seconds_total") > 0, "a heartbeat with the steps")
    text = httpx.get(two_worker_server.url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["tokenmill_router_decisions"].type == "counter"
    assert families["tokenmill_request_migrations"].type == "counter"
    assert families["tokenmill_worker_kv_usage"].type == "gauge"
    assert families["tokenmill_worker_busy_seconds"].type == "counter"
    latency = families["tokenmill_router_decision_latency_seconds"]
    assert latency.type == "histogram"
    buckets = [(float(s.labels["le"]), s.value) for s in latency.samples if s.name.endswith("_bucket")]
    assert [b for b, _ in buckets] == sorted(b for b, _ in buckets) and buckets[-1][0] == math.inf
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] >= 3  # cumulative, and every decision in +Inf
    count = next(s.value for s in latency.samples if s.name.endswith("_count"))
    assert count == counts[-1]


def test_buckets_in_any_order_come_out_ordered_and_partial_histograms_are_left_out() -> None:
    bounds = ["0.001", "0.01", "0.1", "1", "+Inf"]
    series = [("tokenmill_x_seconds_bucket", {"le": le, "w": "a"}, float(i)) for i, le in enumerate(bounds)]
    series += [("tokenmill_x_seconds_sum", {"w": "a"}, 0.5), ("tokenmill_x_seconds_count", {"w": "a"}, 4.0),
               ("tokenmill_y_bucket", {"le": "1"}, 1.0), ("tokenmill_y_sum", {}, 1.0),  # no +Inf bucket
               ("tokenmill_done_total", {"w": "a"}, 7.0), ("tokenmill_depth", {"w": "a"}, 2.0)]
    random.Random(0).shuffle(series)
    families = {f.name: f for f in typed_families(series)}
    assert {n: f.type for n, f in families.items()} == {
        "tokenmill_x_seconds": "histogram", "tokenmill_y": "histogram", "tokenmill_done": "counter",
        "tokenmill_depth": "gauge"}
    x = families["tokenmill_x_seconds"].samples
    assert [s.labels["le"] for s in x if s.name.endswith("_bucket")] == bounds
    assert next(s.value for s in x if s.name.endswith("_count")) == 4.0
    assert families["tokenmill_y"].samples == []
