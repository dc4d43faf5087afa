"""`tokenmill serve --api-servers 2`: two HTTP frontends share the port, each with its own
worker connections and router, and none outlives the deployment."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.serving.conftest import start_server, stop_server
from tests.serving.probes import child_pids


def _frontend_pids(serve_pid: int) -> list[int]:
    """`tokenmill frontend` processes whose parent is the serve process."""
    return [pid for pid, cmdline in child_pids(serve_pid).items() if b"frontend" in cmdline]


def test_two_api_servers_share_the_port_and_both_reach_every_worker(tiny_dense: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dense, tmp_path, "--runner", "mock", "--mock-step-time", "0,0,0,0",
                          "--api-servers", "2", workers=2)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every worker has heard from both frontends
            if all(w["metadata"].get("frontends") == 2 for w in server.registry()):
                break
            time.sleep(0.2)
        assert [w["metadata"].get("frontends") for w in server.registry()] == [2, 2]
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 3, "ignore_eos": True}
        for _ in range(30):  # a fresh connection each: the kernel spreads them over both servers
            with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as client:
                response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 3
        frontends = _frontend_pids(server.process.pid)
        assert len(frontends) == 1  # the serve process is the first server, this is the second
    finally:
        os.kill(server.process.pid, signal.SIGKILL)  # no clean shutdown: the child must notice
        stop_server(server)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in frontends):
        time.sleep(0.1)
    assert not [pid for pid in frontends if _alive(pid)], "an API server outlived tokenmill serve"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_api_server_flags_are_checked_before_anything_starts(tiny_dense: Path) -> None:
    for flags, message in ((["--api-servers", "0"], "--api-servers must be at least 1"),
                           (["--api-servers", "2", "--port", "0"], "needs a fixed --port")):
        done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(tiny_dense),
                               "--runner", "mock", *flags], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, done.stderr
