"""`tokenmill bench serve` against a real `tokenmill serve` (subprocess, loopback socket), in all three modes."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.serving.conftest import Server, start_server, stop_server
from tokenmill.bench.harness.serve_report import TOP_LEVEL_KEYS
from tokenmill.cli import main
from tokenmill.datasets import MOONCAKE_TRACE, data_file

REAL_TRACE = data_file(MOONCAKE_TRACE)
# the first ten records of the real trace and record 42; record 49 is replayed after them
TRACE_LINES = (*range(10), 42)
LATER_LINE = 49  # shares record 42's first 57 hash blocks


@pytest.fixture(scope="module")
def mock_server(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_dense, tmp_path_factory.mktemp("run"), "--runner", "mock",
                          "--mock-step-time", "0.001,0,0,0", "--kv-cache-blocks", "1024")
    try:
        yield server
    finally:
        stop_server(server)


def _bench(server: Server, out: Path, *flags: str) -> dict[str, Any]:
    rc = main(["--log-level", "WARNING", "bench", "serve", "--url", server.url, "--model", "tiny",
               "--json", str(out), "--save-requests", "--quiet", "--timeout-s", "30", "--max-duration-s", "60",
               *flags])
    report = json.loads(out.read_text())
    assert rc == 0, report["results"]["outcomes"]
    return report


def _check_complete_and_exact(report: dict[str, Any]) -> None:
    assert all(key in report for key in TOP_LEVEL_KEYS)
    results, requests = report["results"], report["requests"]
    assert results["requests_ok"] == results["requests_total"] == len(requests) == report["workload"]["num_requests"]
    assert results["outcomes"] == {"ok": len(requests)} and results["length_mismatches"] == 0
    for row in requests:
        assert row["status"] == "ok" and row["finish_reason"] == "length"
        assert (row["prompt_tokens"], row["completion_tokens"]) == (row["prompt_len"], row["output_len"])
    assert results["output_tokens"] == report["workload"]["output_tokens"]
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        dist = results[name]
        if dist is None and name == "itl_ms":
            # a fast runner on a busy host: every stream's tokens arrived in one merged event, so
            # there is no gap to measure (the frontend merges token frames that wait together)
            assert all(not row["itl_s"] for row in requests)
            continue
        assert dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"], name


def test_fixed_concurrency(mock_server: Server, tmp_path: Path) -> None:
    report = _bench(mock_server, tmp_path / "c.json", "--concurrency", "4", "--num-requests", "8",
                    "--min-input", "16", "--max-input", "64", "--min-output", "4", "--max-output", "12",
                    "--usd-per-hour", "2.5", "--slo-ttft-ms", "60000", "--mock-step-ms", "1")
    _check_complete_and_exact(report)
    results = report["results"]
    assert report["config"]["mode"] == "concurrency" and results["slo_met"] == 8
    assert results["usd_per_million_output_tokens"] > 0 and results["overhead_per_token_ms"]["count"] == 8


def test_poisson_rate_with_shared_prefixes_hits_the_cache(mock_server: Server, tmp_path: Path) -> None:
    report = _bench(mock_server, tmp_path / "r.json", "--request-rate", "40", "--num-requests", "8",
                    "--input-len", "16", "--output-len", "6", "--prefix-len", "64", "--num-prefix-groups", "2",
                    "--seed", "5")
    _check_complete_and_exact(report)
    assert report["config"]["mode"] == "request_rate" and report["workload"]["arrival_span_s"] > 0
    assert report["results"]["cached_tokens"] > 0  # 6 of 8 requests repeat a 64-token prefix


def test_trace_replay_of_the_real_trace(mock_server: Server, tmp_path: Path) -> None:
    """Records 42 and 49 of the trace share their first 57 hash blocks. 49 is replayed once 42's
    replay has finished (a second run), so that it finds them cached whatever the machine's speed
    (the check asks for at least 50 of them)."""
    lines = REAL_TRACE.read_text().splitlines()
    first, second = tmp_path / "trace.jsonl", tmp_path / "later.jsonl"
    first.write_text("".join(lines[i] + "\n" for i in TRACE_LINES))
    second.write_text(lines[LATER_LINE] + "\n")
    flags = ("--tokens-per-hash-block", "16", "--time-scale", "0.02", "--max-input-tokens", "1200",
             "--max-output-tokens", "8")
    report = _bench(mock_server, tmp_path / "t.json", "--trace", str(first), *flags)
    _check_complete_and_exact(report)
    assert len(report["requests"]) == len(TRACE_LINES) and report["config"]["mode"] == "trace"
    later = _bench(mock_server, tmp_path / "later.json", "--trace", str(second), *flags)
    _check_complete_and_exact(later)
    assert later["requests"][0]["cached_tokens"] >= 16 * 50  # record 49 reuses record 42's blocks
    assert later["results"]["cached_fraction"] > 0


def test_real_runner(tiny_dense: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dense, tmp_path / "run", "--kv-cache-blocks", "256", "--threads", "1")
    try:
        report = _bench(server, tmp_path / "real.json", "--concurrency", "3", "--num-requests", "4",
                        "--min-input", "8", "--max-input", "40", "--output-len", "5")
    finally:
        stop_server(server)
    _check_complete_and_exact(report)


def test_engine_workload_against_the_mock_reference_and_an_engine_json(mock_server: Server, tiny_dense: Path,
                                                                      tmp_path: Path) -> None:
    workload = ("--concurrency", "4", "--num-requests", "6", "--min-input", "16", "--max-input", "64",
                "--min-output", "4", "--max-output", "8", "--engine-workload", str(tiny_dense))
    report = _bench(mock_server, tmp_path / "m.json", *workload, "--mock-step-ms", "1", "--mock-reference")
    _check_complete_and_exact(report)
    results, comparison = report["results"], report["engine_comparison"]
    assert results["overhead_baseline_ms"] >= 1.0 and results["overhead_per_token_ms"]["count"] == 6
    assert comparison["ratio"] == pytest.approx(results["output_token_throughput"]
                                                / comparison["engine_output_tokens_per_s"])
    engine_json = tmp_path / "engine.json"
    engine_json.write_text(json.dumps({"config": {"num_requests": 6, "min_prompt": 16, "max_prompt": 64,
                                                  "min_output": 4, "max_output": 8, "seed": 0},
                                       "tokenmill": {"output_tokens_per_s": 100.0}}))
    report = _bench(mock_server, tmp_path / "e.json", *workload, "--compare-engine", str(engine_json))
    assert report["engine_comparison"]["ratio"] == pytest.approx(report["results"]["output_token_throughput"] / 100)
