"""A real `nats-server` on loopback for the event-plane tests: a free port, stopped by PID, and
restarted on the same port (so clients reconnect to it)."""
from __future__ import annotations

import socket

from tests.runtime.loopback_server import LoopbackServer
from tokenmill.bench.harness.serve_process import free_port


class NatsServer(LoopbackServer):
    binary, package = "nats-server", "nats-server"

    def __init__(self, host: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        super().__init__(host, prefix)
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> None:
        def greets() -> bool:  # the server greets every client with INFO {...}
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                    return sock.recv(4) == b"INFO"
            except OSError:
                return False

        self.spawn(["-a", self.host, "-p", str(self.port)], greets, f"port {self.port}")
