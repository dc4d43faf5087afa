"""A real `etcd` on loopback for the discovery tests: free ports, its own data directory,
stopped by PID; `restart(fresh=True)` brings it back on the same port with its data gone."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import uvloop

from tests.runtime.loopback_server import LoopbackServer
from tokenmill.bench.harness.serve_process import free_port
from tokenmill.runtime.etcd_discovery import EtcdDiscovery, parse_etcd_url


class EtcdServer(LoopbackServer):
    binary, package = "etcd", "etcd-server"

    def __init__(self, workdir: Path, host: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        super().__init__(host, prefix)
        self.workdir = workdir
        self.client_port, self.peer_port = free_port(), free_port()
        self.generation = 0

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.client_port}"

    def start(self) -> None:
        client, peer = f"http://{self.host}:{self.client_port}", f"http://{self.host}:{self.peer_port}"

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


def registered(url: str) -> dict[str, str]:
    """What a fresh reader of etcd sees under the workers' prefix: worker id -> address."""
    async def read() -> dict[str, str]:
        reader = EtcdDiscovery(*parse_etcd_url(url))
        await reader.start()
        reader.workers()  # starts its watch: a full read first
        try:
            async with asyncio.timeout(10):
                while not reader.connected:
                    await asyncio.sleep(0.02)
            return {w.worker_id: w.address for w in reader.workers()}
        finally:
            await reader.close()
    return uvloop.run(read())
