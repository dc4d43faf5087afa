"""`tokenmill bench router-warmup` end to end, tiny: 2 mock workers holding 4,000 blocks, one fresh
frontend per mode. Asserts what the bench observes (index size, routing to the holder, the cold
option's empty start), never its timings."""
from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

from tests.bench.live_processes import live_pids
from tokenmill.bench.routing.router_warmup_probe import WarmupRun
from tokenmill.cli import main

BLOCKS = 4000  # 2 workers x 125 prompts x 16 blocks: the fill lands on whole prompts exactly


def _bench_processes() -> set[int]:
    """Live pids whose argv names the bench (serve, its workers, measured frontends)."""
    return live_pids(lambda argv: b"router-warmup" in argv)


@pytest.fixture
def short_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The bench's temp root: short, as the workers' ipc socket paths must be (pytest's are too long)."""
    root = Path(tempfile.mkdtemp(prefix="tm-test-"))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_fresh_frontend_warms_from_snapshots_and_routes_probes_to_their_holder(short_tmp: Path) -> None:
    before = _bench_processes()
    out = short_tmp / "out.json"
    rc = main(["--log-level", "WARNING", "bench", "router-warmup", "--workers", "2", "--blocks", str(BLOCKS),
               "--prompt-tokens", "256", "--repeats", "1", "--probe-window-s", "1", "--start-timeout-s", "30",
               "--json", str(out)])
    assert rc == 0
    assert not _bench_processes() - before  # serve, workers and measured frontends all stopped
    assert [p.name for p in short_tmp.iterdir()] == ["out.json"]  # its work dir is gone
    report = json.loads(out.read_text())
    assert report["schema"] == "tokenmill.bench.router_warmup" and report["schema_version"] == 1
    fleet = report["fleet"]
    assert fleet["fill_verified"] and fleet["misplaced_prefixes"] == 0
    assert fleet["truth_blocks"] == fleet["first_frontend_index_blocks"] == BLOCKS
    assert fleet["worker_blocks"] == {"worker-0": BLOCKS // 2, "worker-1": BLOCKS // 2}

    runs = {run["mode"]: run for run in report["runs"]}
    assert set(runs) == {"snapshot", "cold"}
    assert all(set(run) == {f.name for f in fields(WarmupRun)} for run in runs.values())
    snapshot, cold = runs["snapshot"], runs["cold"]
    assert snapshot["final_index_blocks"] >= snapshot["truth_blocks"] >= BLOCKS
    assert snapshot["first_kv_probe_s"] is not None and snapshot["window_kv_probes"] >= 1
    assert cold["index_at_first_probe"] == 0  # --no-kv-snapshot-on-join: nothing before traffic
    assert cold["final_index_blocks"] >= cold["truth_blocks"] and cold["first_kv_probe_s"] is not None
    assert set(report["summary"]) == {"snapshot", "cold"}
    assert all(s["complete"] == s["runs"] == 1 for s in report["summary"].values())
