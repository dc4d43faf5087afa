"""A real `tokenmill serve` (frontend + worker processes) on a free loopback port."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


@dataclass(slots=True)
class Server:
    url: str
    run_dir: Path
    process: subprocess.Popen
    model: str

    def workers(self) -> list[dict]:
        """The registry entries the workers keep fresh with heartbeats."""
        out = []
        for path in (self.run_dir / "registry").glob("*.json"):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                pass
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, run_dir: Path, *flags: str, workers: int = 1) -> Server:
    port = _free_port()
    argv = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", "--model", str(model),
            "--port", str(port), "--workers", str(workers), "--run-dir", str(run_dir),
            "--served-model-name", "tiny", *flags]
    process = subprocess.Popen(argv, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", run_dir, process, "tiny")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tokenmill serve exited with {process.returncode}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200 and len(server.workers()) == workers:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError("tokenmill serve did not become healthy in 90 s")


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
    for info in server.workers():  # never leave a worker behind
        try:
            os.kill(int(info["pid"]), signal.SIGKILL)
        except (ProcessLookupError, KeyError, ValueError):
            pass


@pytest.fixture(scope="module")
def two_worker_server(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_dense, tmp_path_factory.mktemp("run"), "--kv-cache-blocks", "512", workers=2)
    try:
        yield server
    finally:
        stop_server(server)
