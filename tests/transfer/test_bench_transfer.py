"""`tokenmill bench transfer` runs end to end (tiny sizes) and writes its JSON report, also with `--netns`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.runtime import netns


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


@pytest.mark.skipif(netns.netns_unavailable() is not None, reason="network namespaces need root and iproute2")
def test_bench_transfer_netns_pulls_tcp_across_a_veth_and_leaves_no_namespace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[netns.Hosts] = []

    class RecordedHosts(netns.Hosts):
        def __init__(self, count: int) -> None:
            super().__init__(count)
            made.append(self)

    monkeypatch.setattr(netns, "Hosts", RecordedHosts)
    out = tmp_path / "transfer.json"
    assert main(["--log-level", "WARNING", "bench", "transfer", "--netns", "--sizes-mb", "1", "--repeats", "2",
                 "--json", str(out)]) == 0  # each (case, size) is checksummed once: a bad byte fails the run
    report = json.loads(out.read_text())
    assert {(r["backend"], r["case"]) for r in report["rows"]} == {("tcp", "contiguous"), ("tcp", "scattered")}
    assert all(r["netns"] and r["baseline"] == "raw_socket" for r in report["rows"])
    assert all(r["gbps"] > 0 and r["baseline_gbps"] > 0 for r in report["rows"])
    (hosts,) = made
    assert report["netns"]["namespace"] == hosts.names[0]
    assert report["netns"]["peer_tcp"].startswith(f"{hosts.address(1)}:")  # advertised inside, not 127.0.0.1
    assert set(report["targets"]) == {"tcp_contiguous_at_least_0.6x_raw_socket"}
    assert hosts.leftovers() == []


def test_bench_transfer_netns_without_root_is_one_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert main(["bench", "transfer", "--netns", "--sizes-mb", "1"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "--netns" in errors[0] and "root" in errors[0]
