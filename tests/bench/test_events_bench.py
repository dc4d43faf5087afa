"""`tokenmill bench events` end to end, tiny: 4 workers in 2 processes over NATS and ZeroMQ.

Nothing timed is asserted, only that every event reached the index and left it right.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tokenmill.bench.harness.frontend_procs import descendants
from tokenmill.cli import main

WORKERS, EVENTS, RATE, LATENCY_S = 4, 300, 2000, 0.25


def _leftovers() -> list[int]:
    """Live processes below this one, but multiprocessing's resource tracker (it lives as long as we do)."""
    found = []
    for pid in descendants(os.getpid()):
        try:
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue  # exited meanwhile
    return found


def _temp_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("tokenmill-events-*")}


def test_every_event_reaches_the_index_over_both_transports(tmp_path: Path) -> None:
    if shutil.which("nats-server") is None:
        pytest.fail("nats-server is not installed: `apt-get install -y nats-server` (CI does it)")
    out, dirs_before = tmp_path / "events.json", _temp_dirs()
    # a small pool and prompt: evictions start within the first few dozen events
    rc = main(["--log-level", "WARNING", "bench", "events", "--workers", str(WORKERS), "--publisher-procs", "2",
               "--events", str(EVENTS), "--rate", str(RATE), "--latency-s", str(LATENCY_S), "--pool-blocks", "96",
               "--prompt-blocks", "16", "--chunk-blocks", "8", "--output-blocks", "4", "--quiet-s", "2",
               "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "tokenmill.bench.events" and set(report["transports"]) == {"nats", "zmq"}
    for transport, phases in report["transports"].items():
        for name, minimum in (("throughput", WORKERS * EVENTS), ("latency", int(RATE * LATENCY_S))):
            phase = phases[name]
            assert phase["events"] >= minimum, (transport, name)
            assert phase["applied"] == phase["events"] and phase["lost"] == 0 and phase["gaps"] == 0
            assert phase["removed_events"] > 0  # the pools were full: BlockRemoved went through too
            assert phase["index_mismatches"] == 0 and phase["index_blocks"] == phase["held_blocks"] > 0
            assert 0 <= phase["p50_ms"] <= phase["p99_ms"] <= phase["max_ms"]
            assert phase["events_per_s"] > 0 and phase["consumer_cpu_us"] >= 0
    assert multiprocessing.active_children() == []  # the publisher processes were joined
    assert _leftovers() == []  # nats-server included
    assert _temp_dirs() <= dirs_before  # the ipc sockets' directory is gone
