"""A real `etcd` on loopback for the discovery tests: free ports, its own data directory,
stopped by PID; `restart(fresh=True)` brings it back on the same port with its data gone."""
from __future__ import annotations

from pathlib import Path

import httpx

from tests.runtime.loopback_server import LoopbackServer
from tokenmill.bench.serve_process import free_port


class EtcdServer(LoopbackServer):
    binary, package = "etcd", "etcd-server"

    def __init__(self, workdir: Path) -> None:
        super().__init__()
        self.workdir = workdir
        self.client_port, self.peer_port = free_port(), free_port()
        self.generation = 0

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{client}/health", timeout=0.5, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        self.spawn(["--name", "tokenmill-test", "--data-dir", str(self.workdir / f"data-{self.generation}"),
                    "--listen-client-urls", client, "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"tokenmill-test={peer}"], healthy, f"port {self.client_port}")

    def restart(self, fresh: bool) -> None:
        self.stop()
        if fresh:
            self.generation += 1
        self.start()
