"""A real `nats-server` on loopback for the event-plane tests: a free port, stopped by PID, and
restarted on the same port (so clients reconnect to it)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class NatsServer:
    def __init__(self) -> None:
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("nats-server")
        if binary is None:
            pytest.fail("nats-server is not installed: `apt-get install -y nats-server` (CI does it)")
        self.process = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    if sock.recv(4) == b"INFO":  # the server greets every client with INFO {...}
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                pytest.fail(f"nats-server did not come up on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None
