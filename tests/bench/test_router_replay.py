"""`tokenmill bench router-replay` end to end: two policies over a tiny trace with repeated prefixes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.live_processes import live_pids
from tokenmill.bench.routing.router_replay import PolicyResult, reusable_fraction
from tokenmill.cli import main

GROUPS, ROUNDS = 3, 4  # records cycle g0 g1 g2 g0 …: with 2 workers, round-robin splits every group
PREFIX_IDS, SUFFIX_IDS = 4, 1


def _write_trace(path: Path) -> None:
    """12 Mooncake records 150 ms apart: a group's 4-block prefix, then one block of its own."""
    lines = []
    for i in range(GROUPS * ROUNDS):
        group = i % GROUPS
        hash_ids = [group * 10 + k for k in range(PREFIX_IDS)] + [1000 + i]
        lines.append(json.dumps({"timestamp": 150 * i, "input_length": 512 * len(hash_ids),
                                 "output_length": 3, "hash_ids": hash_ids}))
    path.write_text("\n".join(lines) + "\n")


def _replay(tiny_dense: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out.json"
    _write_trace(trace)
    rc = main(["--log-level", "WARNING", "bench", "router-replay", "--model", str(tiny_dense), "--trace", str(trace),
               "--policies", "kv,round-robin", "--workers", "2", "--tokens-per-hash-block", "32",
               "--time-scale", "1.0", "--kv-cache-blocks", "128", "--mock-step-time", "0.001,0.00002,0.0001,0",
               "--timeout-s", "30", "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def _our_processes(model: Path) -> set[int]:
    """Live pids of servers and workers a replay over `model` started (their argv names both)."""
    return live_pids(lambda argv: any(b"router-replay" in a for a in argv) and str(model).encode() in b" ".join(argv))


def test_kv_computes_no_more_prefill_than_round_robin(tiny_dense: Path, tmp_path: Path) -> None:
    rc, report = _replay(tiny_dense, tmp_path)
    assert rc == 0
    assert not _our_processes(tiny_dense)  # every server and worker was stopped
    assert report["schema"] == "tokenmill.bench.routing.router_replay"
    assert set(report["policies"]) == {"kv", "round-robin"}
    total_records = GROUPS * ROUNDS
    for result in report["policies"].values():
        assert set(result) == set(PolicyResult.__slots__)
        assert result["requests_ok"] == result["requests_total"] == total_records
        assert result["prompt_tokens"] == total_records * (PREFIX_IDS + SUFFIX_IDS) * 32
        assert result["prefill_tokens_computed"] == result["prompt_tokens"] - result["cached_tokens"]
        assert sum(result["worker_requests"]) >= total_records  # plus the warm-up request
    kv, rr = report["policies"]["kv"], report["policies"]["round-robin"]
    assert kv["cached_tokens"] > 0
    assert kv["prefill_tokens_computed"] <= rr["prefill_tokens_computed"]
    assert report["ttft_ratio_round_robin_over_kv"] == pytest.approx(rr["ttft_ms_mean"] / kv["ttft_ms_mean"])
    assert report["workload"]["reusable_fraction"] == pytest.approx((ROUNDS - 1) * PREFIX_IDS / (ROUNDS * 5))


@pytest.mark.parametrize(("flag", "value"), [("--policies", "kv,nope"), ("--workers", "0"),
                                             ("--mock-step-time", "1,2,3"), ("--max-input-tokens", "4000")])
def test_bad_flags_exit_2(flag: str, value: str, tiny_dense: Path, tmp_path: Path,
                          caplog: pytest.LogCaptureFixture) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace)
    rc = main(["bench", "router-replay", "--model", str(tiny_dense), "--trace", str(trace), flag, value])
    assert rc == 2
    assert flag in caplog.text


def test_reusable_fraction_counts_leading_seen_blocks() -> None:
    from tokenmill.workloads.prompt_synth import RequestSpec

    specs = [RequestSpec([0] * 8, 1, 0.0, (1, 2)), RequestSpec([0] * 8, 1, 0.0, (1, 3)),
             RequestSpec([0] * 6, 1, 0.0, (1, 2, 9))]
    assert reusable_fraction(specs, 4) == pytest.approx((0 + 4 + 6) / 22)
