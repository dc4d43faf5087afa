"""A server binary the tests start on a free port and stop by PID (etcd, nats-server): on loopback,
or on a network namespace's address (`prefix`: `ip netns exec NS`)."""
from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable

import pytest


class LoopbackServer:
    binary = ""  # the command, as Debian installs it
    package = ""  # the Debian package that has it

    def __init__(self, host: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        self.host, self.prefix = host, prefix
        self.process: subprocess.Popen[bytes] | None = None

    def spawn(self, argv: list[str], ready: Callable[[], bool], what: str) -> None:
        """Start `binary argv…` and wait (20 s at most) until `ready()`; fail the test otherwise."""
        binary = shutil.which(self.binary)
        if binary is None:
            pytest.fail(f"{self.binary} is not installed: `apt-get install -y {self.package}` (CI does it)")
        self.process = subprocess.Popen([*self.prefix, binary, *argv], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not ready():
            if time.monotonic() > deadline or self.process.poll() is not None:
                pytest.fail(f"{self.binary} did not come up on {what}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None
