"""What the multi-host tests share: four network namespaces (hosts 1-3 for tokenmill processes,
host 4 for etcd and NATS), the command lines that put a worker or frontend on a host, and a
fleet context that stops everything and then checks that nothing is left: no process,
namespace, link or shared-memory file."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.runtime.etcd_server import EtcdServer
from tests.runtime.nats_server import NatsServer
from tests.serving.probes import wait
from tokenmill.runtime.netns import Hosts
from tokenmill.transfer.memory import SHM_DIR, SHM_PREFIX

INFRA = 4


@dataclass
class Fleet:
    hosts: Hosts
    model: Path
    etcd: EtcdServer
    nats: NatsServer
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_worker(self, host: int, role: str, name: str) -> subprocess.Popen[bytes]:
        address = self.hosts.address(host)
        return self._spawn(host, "worker", "--role", role, "--worker-id", name, "--address", f"tcp://{address}:0",
                           "--kv-transfer-backends", "tcp", "--kv-transfer-host", address,
                           "--discovery-ttl-s", "1")

    def start_frontend(self, host: int, port: int, *flags: str) -> str:
        self._spawn(host, "frontend", "--host", self.hosts.address(host), "--port", str(port), *flags)
        return f"http://{self.hosts.address(host)}:{port}"

    def _spawn(self, host: int, command: str, *flags: str) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [*self.hosts.prefix(host), sys.executable, "-m", "tokenmill.cli", command, "--model", str(self.model),
             "--served-model-name", "tiny", "--discovery", self.etcd.url, "--event-plane", self.nats.url, *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.processes.append(process)
        return process


@contextmanager
def fleet(hosts: Hosts, model: Path, workdir: Path) -> Iterator[Fleet]:
    """etcd and NATS on host 4; on the way out every process is killed if still alive, the
    servers and namespaces go, and nothing of them may remain."""
    infra = hosts.address(INFRA)
    made = Fleet(hosts, model, EtcdServer(workdir, infra, hosts.prefix(INFRA)), NatsServer(infra, hosts.prefix(INFRA)))
    try:
        made.etcd.start()
        made.nats.start()
        yield made
    finally:
        for process in made.processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        made.nats.stop()
        made.etcd.stop()
    hosts.close()
    wait(lambda: hosts.leftovers() == [], "the namespaces and their links to go", timeout_s=30)  # freed lazily
    assert not [p for process in made.processes for p in SHM_DIR.glob(f"{SHM_PREFIX}{process.pid}-*")]
