"""`tokenmill bench router` end to end on a small index (figures are not asserted: no wall clock)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.bench.harness.router_workload import ChainFactory, build_fleet, event_stream
from tokenmill.cli import main
from tokenmill.kv.events import BlockRemoved, BlockStored
from tokenmill.router.indexer import KVIndexer


def test_bench_router_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "router.json"
    code = main(["bench", "router", "--workers", "8", "--blocks", "4000", "--prompt-tokens", "512",
                 "--decisions", "40", "--window", "8", "--events", "3000", "--prefixes", "16",
                 "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["index_blocks"] == 4000 and report["workers"] == 8
    assert report["prompt_blocks"] == 32 and report["decisions"] == 40 and report["events"] == 3000
    assert report["mean_matched_workers"] > 0  # the prompts share prefixes with the index
    assert set(report["targets"]) == {"decision_p99_below_1ms", "events_per_s_at_least_200k"}
    assert "decisions/s" in capsys.readouterr().out


def test_synthetic_events_keep_the_index_size_steady_and_ids_contiguous() -> None:
    chains = ChainFactory(num_prefixes=8, prefix_blocks=32, seed=1)
    fleet = build_fleet(chains, num_workers=4, total_blocks=2000, sequence_blocks=32)
    index = KVIndexer()
    for event in fleet.build_events:
        index.apply(event)
    assert index.num_blocks() == 2000
    events = event_stream(fleet, chains, 2000, prompt_blocks=32, output_blocks=4, chunk_blocks=8)
    assert {type(e) for e in events} == {BlockStored, BlockRemoved}
    statuses = {index.apply(event).value for event in events}
    assert statuses == {"applied"}
    assert abs(index.num_blocks() - 2000) <= 4 * 8  # each worker is at most one chunk ahead
