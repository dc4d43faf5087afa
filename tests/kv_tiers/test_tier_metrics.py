"""Tier stats travel in the worker's heartbeat load and come out of `/metrics` per worker and tier."""
from __future__ import annotations

import argparse

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.api.metrics import FrontendMetrics
from tokenmill.backend import tier_gauges
from tokenmill.engine.cli_args import add_engine_arguments, engine_argv, engine_config_from_args
from tokenmill.engine.kv_tiers_wiring import tier_load

TIER_STATS = {"tiers": {"host": {"hits": 5, "misses": 2, "used_bytes": 4096, "capacity_bytes": 8192, "puts": 9},
                        "shared": {"hits": 1, "misses": 7, "errors": 3, "used_bytes": 0, "capacity_bytes": 100}},
              "onboard_blocks": 6, "offload_stored": 9, "offload_dropped": 0}


def test_tier_load_flattens_per_tier_counters() -> None:
    load = tier_load(TIER_STATS)
    assert load["tier_host_hits"] == 5.0 and load["tier_shared_errors"] == 3.0
    assert load["tier_host_used_bytes"] == 4096.0 and "tier_host_puts" not in load
    assert load["kv_onboard_blocks"] == 6.0
    assert tier_load({}) == {}


def test_metrics_show_tier_gauges_per_worker_and_tier() -> None:
    snapshot = {"tokenmill_workers": 1.0, **tier_gauges("w0", {"num_running": 1, **tier_load(TIER_STATS)})}
    text = generate_latest(FrontendMetrics(lambda: snapshot).registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("tokenmill_worker_kv_tier_hits", (("tier", "host"), ("worker", "w0")))] == 5.0
    assert samples[("tokenmill_worker_kv_tier_misses", (("tier", "shared"), ("worker", "w0")))] == 7.0
    assert samples[("tokenmill_worker_kv_tier_used_bytes", (("tier", "host"), ("worker", "w0")))] == 4096.0


def test_tier_flags_round_trip_through_engine_argv() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", "m", "--kv-host-gb", "2", "--kv-disk-dir", "/d", "--kv-disk-gb", "8",
                              "--kv-shared", "redis://127.0.0.1:1/0", "--kv-shared-gb", "1",
                              "--kv-write-through", "--kv-pin-file", "p.jsonl"])
    again = engine_config_from_args(parser.parse_args(engine_argv(args)))
    assert again == engine_config_from_args(args)
    assert (again.kv_host_gb, again.kv_disk_dir, again.kv_shared, again.kv_write_through) == (
        2.0, "/d", "redis://127.0.0.1:1/0", True)
    with pytest.raises(ValueError, match="kv_disk_gb needs kv_disk_dir"):
        engine_config_from_args(parser.parse_args(["--model", "m", "--kv-disk-gb", "8"]))
