"""`tokenmill bench transfer` runs end to end (tiny sizes) and writes its JSON report."""
from __future__ import annotations

import json
from pathlib import Path

from tokenmill.cli import main


def test_bench_transfer_writes_rows_for_both_backends_and_cases(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    assert main(["--log-level", "WARNING", "bench", "transfer", "--sizes-mb", "1", "--repeats", "1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {(r["backend"], r["case"]): r for r in report["rows"]}
    assert set(rows) == {(b, c) for b in ("shm", "tcp") for c in ("contiguous", "scattered")}
    assert rows[("shm", "contiguous")]["baseline"] == "memcpy"
    assert rows[("tcp", "scattered")]["baseline"] == "raw_socket"
    assert rows[("shm", "contiguous")]["descriptors"] == 2 * report["layers"]
    assert all(r["gbps"] > 0 and r["baseline_gbps"] > 0 for r in report["rows"])
    assert set(report["targets"]) == {"shm_contiguous_at_least_0.6x_memcpy", "tcp_contiguous_at_least_0.6x_raw_socket"}
