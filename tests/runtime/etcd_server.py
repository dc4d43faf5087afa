"""A real `etcd` on loopback for the discovery tests: free ports, its own data directory,
stopped by PID; `restart(fresh=True)` brings it back on the same port with its data gone."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EtcdServer:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.generation = 0

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.fail("etcd is not installed: `apt-get install -y etcd-server` (CI does it)")
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.process = subprocess.Popen(
            [binary, "--name", "tokenmill-test", "--data-dir", str(self.workdir / f"data-{self.generation}"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"tokenmill-test={peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{client}/health", timeout=0.5, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                pytest.fail(f"etcd did not come up on port {self.client_port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def restart(self, fresh: bool) -> None:
        self.stop()
        if fresh:
            self.generation += 1
        self.start()
