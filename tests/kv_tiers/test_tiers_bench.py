"""`tokenmill bench tiers` end to end on a tiny model (token counts only, never timings)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenmill.cli import main


def test_bench_tiers_runs_and_tiers_skip_prefill(tiny_dense: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    argv = ["bench", "tiers", "--model", str(tiny_dense), "--agents", "4", "--turns", "3", "--corpus-tokens", "64",
            "--turn-tokens", "32", "--output-tokens", "4", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    device, *tiered = report["agentic"]
    assert device["name"] == "device-only" and device["onboarded_tokens"] == 0
    assert tiered and all(r["prefill_tokens"] < device["prefill_tokens"] and r["onboarded_tokens"] > 0 for r in tiered)
    cross = report["cross_replica"]
    assert cross["prefill_tokens_shared"] < cross["prefill_tokens_none"]
