"""`tokenmill worker --health-port`: the readiness probe an orchestrator polls (and the graceful
drain a pod's preStop hook starts with SIGUSR1)."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.serving.probes import wait
from tokenmill.bench.harness.serve_process import free_port
from tokenmill.worker.health import HealthServer


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code
    except httpx.HTTPError:
        return None


def test_the_endpoint_follows_readiness() -> None:
    state = {"ready": False}
    server = HealthServer("127.0.0.1", 0, lambda: state["ready"])
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert _status(f"{base}/health") == 503
        state["ready"] = True
        assert _status(f"{base}/health") == 200
        assert _status(f"{base}/metrics") == 404
    finally:
        server.close()


def test_a_worker_is_ready_once_registered_and_drains_to_a_clean_exit(tiny_dense: Path, tmp_path: Path) -> None:
    port, registry = free_port(), tmp_path / "registry"
    worker = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "worker", "--model", str(tiny_dense),
                               "--runner", "mock", "--mock-step-time", "0.002,0,0,0", "--worker-id", "w0",
                               "--address", f"ipc://{tmp_path}/w0.sock", "--discovery", f"file:{registry}",
                               "--health-port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait(lambda: _status(f"http://127.0.0.1:{port}/health") == 200, "the worker to be ready", timeout_s=120)
        assert (registry / "w0.json").exists()
        worker.send_signal(signal.SIGUSR1)  # what the pod's preStop hook sends
        assert worker.wait(timeout=60) == 0
        assert not (registry / "w0.json").exists()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=10)
