"""The fleet simulator agrees with the live system it models (small; the full size is a benchmark).

The same Mooncake slice goes through `tokenmill serve --runner mock --mock-profile …` (real
processes, the frontend's KV router) and through the fleet simulator with the same profile.
The profile's steps are long (405B on 8 H100s, played at a quarter speed) and the prompts too, so
the live system's own host time per request (HTTP, sockets, the frontend) stays small next to the
modelled GPU time.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenmill.bench.fleet import fleet_agreement
from tokenmill.datasets import MOONCAKE_TRACE, data_file

# A quarter speed: the live host's own time per request (10-20 ms on a quiet 2-core machine, two or
# three times that on a busy one) counts a quarter in modelled time. At full speed p90 ratios were
# ~0.83 against the 0.85 bound, at half speed ~0.93 here and 0.84 once in CI; so ~0.96. The trace's
# gaps are halved (--time-scale) and none is left longer than GAP_CAP_MS, far more than a request
# takes, so the quiet spells cost no wall time and no two requests overlap that did not before.
GAP_CAP_MS = 1000.0
ARGS = ["--profile", "llama-3.1-405b@h100:fp8:tp8", "--speedup", "0.25", "--max-requests", "30", "--time-scale", "0.5",
        "--max-output-tokens", "8", "--tokens-per-hash-block", "64", "--kv-cache-blocks", "2000"]
# Records of the shipped trace whose prompts share prefixes with one another (1 and 121, 15 and 58, 74
# and 90, ...), topped up with the first records whose prompts are long (>= 256 tokens at 64 tokens per
# hash id: a TTFT of >= 100 ms modelled, far above the live system's own few ms), in trace order.
SHARING = (1, 3, 15, 42, 49, 57, 58, 61, 74, 87, 90, 104, 121, 123, 124, 137, 180)


def _slice(path: Path) -> Path:
    lines = data_file(MOONCAKE_TRACE).read_text().splitlines()
    long_prompts = [i for i, line in enumerate(lines[:200])
                    if json.loads(line)["input_length"] * 64 // 512 >= 256 and i not in SHARING]
    chosen = [json.loads(lines[i]) for i in sorted({*SHARING, *long_prompts[:30 - len(SHARING)]})]
    at, previous = 0.0, chosen[0]["timestamp"]
    for record in chosen:
        at += min(record["timestamp"] - previous, GAP_CAP_MS)
        previous, record["timestamp"] = record["timestamp"], at
    path.write_text("".join(json.dumps(record) + "\n" for record in chosen))
    return path


def _args(model: Path, work_dir: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fleet_agreement.add_arguments(parser)
    return parser.parse_args(["--model", str(model), "--work-dir", str(work_dir), *ARGS])


@pytest.mark.parametrize("mode", ["agg", "1p1d"])
def test_live_mock_fleet_and_simulator_agree(mode: str, tiny_dense: Path, tmp_path: Path) -> None:
    trace = _slice(tmp_path / "slice.jsonl")
    row = fleet_agreement.agreement(str(trace), mode, _args(tiny_dense, tmp_path), tmp_path)
    assert row["requests"] == 30
    assert row["cached_identical"] >= 0.95
    assert row["live"]["hit_rate"] > 0  # the slice does share prefixes: the check above is not vacuous
    ratio = row["ratio"]
    assert 0.85 <= ratio["ttft_p50_s"] <= 1.15, row
    assert 0.85 <= ratio["ttft_p90_s"] <= 1.15, row
    assert 0.90 <= ratio["itl_mean_s"] <= 1.10, row
