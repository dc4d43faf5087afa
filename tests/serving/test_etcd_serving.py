"""A frontend and workers that find each other only through a real etcd, registered at their
advertised host (`localhost` for a loopback bind: tests bind nothing else): requests are
served, a SIGKILLed worker's registration ends with its lease and the survivor serves on, and a
clean stop deletes its key."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.runtime.etcd_server import EtcdServer, registered
from tests.serving.probes import answers, metric, wait
from tokenmill.bench.harness.serve_process import free_port

MOCK = ("--runner", "mock", "--mock-step-time", "0.002,0,0,0")


def _spawn(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tokenmill.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def test_frontend_and_workers_meet_through_etcd(tiny_dense: Path, tmp_path: Path,
                                                processes: list[subprocess.Popen[bytes]]) -> None:
    etcd = EtcdServer(tmp_path)
    etcd.start()
    try:
        url, port = f"{etcd.url}/test-fleet", free_port()
        for name in ("w0", "w1"):
            processes.append(_spawn("worker", "--model", str(tiny_dense), *MOCK, "--worker-id", name,
                                    "--address", "tcp://127.0.0.1:0", "--advertise-host", "localhost",
                                    "--events-address", "tcp://127.0.0.1:0", "--discovery", url,
                                    "--discovery-ttl-s", "1"))
        processes.append(_spawn("frontend", "--model", str(tiny_dense), "--discovery", url, "--port", str(port)))
        base = f"http://127.0.0.1:{port}"
        wait(lambda: answers(base) and metric(base, "tokenmill_workers") == 2, "both workers", timeout_s=120)
        entries = registered(url)
        assert sorted(entries) == ["w0", "w1"]
        assert all(address.startswith("tcp://localhost:") for address in entries.values())  # advertised
        body = {"model": tiny_dense.resolve().name, "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True}
        for _ in range(4):
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=30, trust_env=False)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4, reply.text

        os.kill(processes[1].pid, signal.SIGKILL)
        wait(lambda: sorted(registered(url)) == ["w0"], "its lease to end", timeout_s=20)
        wait(lambda: metric(base, "tokenmill_workers") == 1, "the frontend to drop it")
        for _ in range(4):
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=30, trust_env=False)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4, reply.text

        processes[0].send_signal(signal.SIGTERM)
        assert processes[0].wait(timeout=30) == 0
        assert registered(url) == {}  # a clean stop deletes its key at once
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        etcd.stop()
