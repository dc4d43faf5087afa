"""The fleet simulator agrees with the live system it models (small; the full size is a benchmark).

The same Mooncake slice goes through `tokenmill serve --runner mock --mock-profile …` (real
processes, the frontend's KV router) and through the fleet simulator with the same profile.
The profile's steps are long (405B on 8 H100s, played at half speed) and the prompts too, so the
live system's own host time per request (HTTP, sockets, the frontend) stays small next to the
modelled GPU time.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenmill.bench import fleet_agreement
from tokenmill.datasets import MOONCAKE_TRACE, data_file

# Half speed with the trace's gaps halved: the same wall time, and the live host's own time per
# request (a few tens of ms at p90 on 2 busy cores) counts half in modelled time (p90 ratios ~0.83
# at full speed, against the 0.85 bound; ~0.97 so).
ARGS = ["--profile", "llama-3.1-405b@h100:fp8:tp8", "--speedup", "0.5", "--max-requests", "30", "--time-scale", "0.5",
        "--max-output-tokens", "8", "--tokens-per-hash-block", "64", "--kv-cache-blocks", "2000"]
# Records of the shipped trace whose prompts share prefixes with one another (1 and 121, 15 and 58, 74
# and 90, ...), topped up with the first records whose prompts are long (>= 256 tokens at 64 tokens per
# hash id: a TTFT of >= 100 ms modelled, far above the live system's own few ms), in trace order.
SHARING = (1, 3, 15, 42, 49, 57, 58, 61, 74, 87, 90, 104, 121, 123, 124, 137, 180)


def _slice(path: Path) -> Path:
    lines = data_file(MOONCAKE_TRACE).read_text().splitlines()
    long_prompts = [i for i, line in enumerate(lines[:200])
                    if json.loads(line)["input_length"] * 64 // 512 >= 256 and i not in SHARING]
    chosen = sorted({*SHARING, *long_prompts[:30 - len(SHARING)]})
    path.write_text("".join(lines[i] + "\n" for i in chosen))
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
