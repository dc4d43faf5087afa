"""A real `nats-server` on loopback for the event-plane tests: a free port, stopped by PID, and
restarted on the same port (so clients reconnect to it)."""
from __future__ import annotations

import socket

from tests.runtime.loopback_server import LoopbackServer
from tokenmill.bench.serve_process import free_port


class NatsServer(LoopbackServer):
    binary, package = "nats-server", "nats-server"

    def __init__(self) -> None:
        super().__init__()
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        def greets() -> bool:  # the server greets every client with INFO {...}
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    return sock.recv(4) == b"INFO"
            except OSError:
                return False

        self.spawn(["-a", "127.0.0.1", "-p", str(self.port)], greets, f"port {self.port}")
