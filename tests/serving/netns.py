"""Hosts for the multi-host tests: Linux network namespaces on one bridge (the tests run as root).

Host i (1-based) is namespace `tm<tag>-<i>` with address 10.231.<k>.<i>/24 on its `eth0`, a veth
whose other end sits on bridge `tmb<tag>` in the test's own namespace (10.231.<k>.254), so the
test reaches every host and every host reaches the others. `close()` deletes the namespaces
(their veths go with them) and the bridge; `leftovers()` says what of it still exists.
"""
from __future__ import annotations

import os
import subprocess


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    def __init__(self, count: int) -> None:
        self.tag = str(os.getpid() % 100_000)
        self.subnet = f"10.231.{os.getpid() % 200 + 20}"
        self.bridge = f"tmb{self.tag}"
        self.names = [f"tm{self.tag}-{i}" for i in range(1, count + 1)]
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index, name in enumerate(self.names, start=1):
                self._add(index, name)
        except subprocess.CalledProcessError as exc:
            self.close()
            raise RuntimeError(f"could not make network namespaces (root and iproute2 needed): {exc.stderr}") from exc

    def _add(self, index: int, name: str) -> None:
        veth = f"tmv{self.tag}-{index}"
        _ip("netns", "add", name)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", name, "addr", "add", f"{self.subnet}.{index}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host}"

    def prefix(self, host: int) -> tuple[str, ...]:
        """The command prefix that runs a process on `host`."""
        return ("ip", "netns", "exec", self.names[host - 1])

    def close(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)

    def leftovers(self) -> list[str]:
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
        return ([n for n in self.names if n in namespaces.split()]
                + [line.split(":")[1].strip() for line in links.splitlines()
                   if self.bridge in line or f"tmv{self.tag}-" in line])
