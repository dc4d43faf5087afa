"""`tokenmill bench disagg` end to end on tiny-dense (two real `tokenmill serve` arms), and its pure helpers.

Timings are never asserted: only the report's structure and that every request completed with
exactly the asked prompt and answer lengths, in both arms.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill.bench.harness.serve_observe import count_server_events, decisions_delta, parse_decisions
from tokenmill.bench.kv.disagg_bench import expected_workers
from tokenmill.bench.kv.disagg_figures import AGGREGATED, DISAGGREGATED
from tokenmill.bench.kv.disagg_workload import LONG, SHORT, Mix, build_workload
from tokenmill.cli import main

NUM_REQUESTS, LONG_PROMPT, SHORT_PROMPT, OUTPUT_LEN = 10, 96, 16, 6
AGG_FLAGS = "--workers 2 --threads 1 --kv-cache-blocks 256"  # a small pool starts faster


def _disagg_flags() -> str:
    """The real 1 prefill + 1 decode deployment once `tokenmill serve` takes --prefill/--decode
    (every prompt prefilled remotely, so the transfer path is exercised); two aggregated workers before."""
    from tokenmill.serve_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    help_text = parser.format_help()
    if "--prefill" not in help_text or "--decode" not in help_text:
        return AGG_FLAGS
    flags = "--prefill 1 --decode 1 --threads 1 --kv-cache-blocks 256"
    return flags + (" --disagg-threshold 0" if "--disagg-threshold" in help_text else "")


@pytest.fixture(scope="module")
def report(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("disagg") / "report.json"
    rc = main(["--log-level", "WARNING", "bench", "disagg", "--model", str(tiny_dense),
               "--num-requests", str(NUM_REQUESTS), "--rate", "20", "--seed", "3",
               "--long-prompt", str(LONG_PROMPT), "--short-prompt", str(SHORT_PROMPT),
               "--output-len", str(OUTPUT_LEN), "--warmup-requests", "2",
               "--agg-flags", AGG_FLAGS, "--disagg-flags", _disagg_flags(),
               "--timeout-s", "30", "--max-duration-s", "60", "--start-timeout-s", "60",
               "--json", str(out), "--save-requests", "--quiet"])
    data = json.loads(out.read_text())
    assert rc == 0, {name: arm["results"]["outcomes"] for name, arm in data["arms"].items()}
    return data


def test_report_structure(report: dict[str, Any]) -> None:
    assert report["schema"] == "tokenmill.bench.disagg" and report["schema_version"] == 1
    assert set(report) == {"schema", "schema_version", "config", "workload", "arms", "comparison"}
    assert report["config"]["disagg_flags"] == _disagg_flags() and report["config"]["rate"] == 20
    workload = report["workload"]
    assert (workload["num_requests"], workload["long_requests"], workload["short_requests"]) == (NUM_REQUESTS, 2, 8)
    assert workload["output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    assert workload["prompt_tokens"] == 2 * LONG_PROMPT + 8 * SHORT_PROMPT
    assert list(report["arms"]) == [AGGREGATED, DISAGGREGATED]
    for arm in report["arms"].values():
        assert set(arm) == {"serve_flags", "results", "by_class", "load", "disagg_decisions", "requests"}
        assert set(arm["by_class"]) == {LONG, SHORT}
        assert (arm["by_class"][LONG]["requests"], arm["by_class"][SHORT]["requests"]) == (2, 8)
        for dist in (arm["results"]["ttft_ms"], arm["results"]["itl_ms"], arm["by_class"][LONG]["ttft_ms"]):
            assert dist["p50"] <= dist["p99"] <= dist["max"]
        assert len(arm["load"]["worker_cpu_utilization"]) == 2  # both arms run two worker processes
        assert set(arm["load"]["server_events"]) == {"worker_drops", "migrations"}
        decisions = arm["disagg_decisions"]
        assert decisions is None or all(set(d) == {"decision", "reason", "count"} for d in decisions)
    comparison = report["comparison"]
    assert comparison["p99_itl_target_max"] == 0.5 and comparison["output_tokens_per_s_target_min"] == 0.75
    assert comparison["p99_itl_ratio"] > 0 and comparison["output_tokens_per_s_ratio"] > 0
    assert isinstance(comparison["p99_itl_met"], bool) and isinstance(comparison["output_tokens_per_s_met"], bool)


def test_every_request_completes_with_exact_lengths_in_both_arms(report: dict[str, Any]) -> None:
    for name, arm in report["arms"].items():
        results = arm["results"]
        assert results["outcomes"] == {"ok": NUM_REQUESTS}, name
        assert results["length_mismatches"] == 0 and results["output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
        for row in arm["requests"]:
            assert row["status"] == "ok" and row["finish_reason"] == "length", (name, row)
            assert row["completion_tokens"] == OUTPUT_LEN
            assert row["prompt_tokens"] == (LONG_PROMPT if row["class"] == LONG else SHORT_PROMPT)


def test_both_arms_get_the_same_requests(report: dict[str, Any]) -> None:
    agg, dis = (report["arms"][name]["requests"] for name in (AGGREGATED, DISAGGREGATED))
    assert [(r["class"], r["prompt_len"]) for r in agg] == [(r["class"], r["prompt_len"]) for r in dis]


def test_workload_is_seeded_with_an_exact_long_share() -> None:
    mix = Mix(50, 1500, 64, 0.2, 128)
    specs, classes = build_workload(mix, 2.0, 7, 8192)
    again, _ = build_workload(mix, 2.0, 7, 8192)
    assert classes.count(LONG) == 10 and [s.prompt for s in specs] == [s.prompt for s in again]
    assert [len(s.prompt) for s in specs] == [1500 if c == LONG else 64 for c in classes]
    assert all(s.output_len == 128 for s in specs)
    assert [s.arrival_s for s in specs] == [s.arrival_s for s in again] and specs[0].arrival_s == 0.0
    assert all(3 <= t < 8192 for s in specs for t in s.prompt)
    with pytest.raises(ValueError, match="--long-fraction"):
        Mix(10, 100, 10, 1.5, 8)


def test_expected_workers_from_serve_flags() -> None:
    assert expected_workers(["--workers", "2", "--threads", "1"]) == 2
    assert expected_workers(["--prefill", "1", "--decode", "1", "--disagg-threshold", "0"]) == 2
    assert expected_workers(["--prefill", "2", "--decode", "3"]) == 5
    assert expected_workers(["--threads", "1"]) == 1


def test_decision_counters_parsed_and_differenced() -> None:
    text = "\n".join([
        "# HELP tokenmill_disagg_decisions_total prefill placement",
        "# TYPE tokenmill_disagg_decisions_total counter",
        'tokenmill_disagg_decisions_total{decision="remote",reason="long_prompt"} 12.0',
        'tokenmill_disagg_decisions_total{decision="local",reason="below_threshold"} 40.0',
        'tokenmill_disagg_decisions_created{decision="remote",reason="long_prompt"} 1.7e9',
        "tokenmill_output_tokens_total 100.0",
    ])
    after = parse_decisions(text)
    assert after == {("remote", "long_prompt"): 12.0, ("local", "below_threshold"): 40.0}
    assert parse_decisions("tokenmill_output_tokens_total 1.0\n") == {}
    delta = decisions_delta({("remote", "long_prompt"): 2.0}, after)
    assert delta == [{"decision": "local", "reason": "below_threshold", "count": 40},
                     {"decision": "remote", "reason": "long_prompt", "count": 10}]
    assert decisions_delta(None, None) is None


def test_server_events_counted_from_the_serve_log(tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    log_path.write_text(
        "2026-11-30 14:11:11,547 WARNING tokenmill.fleet.worker_pool: worker worker-1 left (deregistered); "
        "6 requests to migrate\n"
        "2026-11-30 14:11:11,548 WARNING tokenmill.fleet.distributed_backend: migrating a request off worker "
        "worker-1 after 3 tokens\n"
        "2026-11-30 14:11:11,549 WARNING tokenmill.fleet.distributed_backend: migrating a request off worker "
        "worker-1 after 0 tokens\n"
        "2026-11-30 14:12:00,000 WARNING tokenmill.fleet.worker_pool: worker decode-0 left (heartbeat timeout); "
        "0 requests to migrate\n")
    assert count_server_events(log_path) == {"worker_drops": 2, "migrations": 2}
    assert count_server_events(tmp_path / "missing.log") is None
