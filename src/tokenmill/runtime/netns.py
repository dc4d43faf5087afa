"""Hosts as Linux network namespaces on one bridge, for the multi-host tests and `bench transfer --netns`.

Host i (1-based) is namespace `tm<tag>-<i>` with address 10.231.<k>.<i>/24 on its `eth0`, a veth
whose other end sits on bridge `tmb<tag>` in the caller's own namespace (10.231.<k>.254), so the
caller reaches every host and every host reaches the others. `close()` deletes it all;
`leftovers()` says what of it still exists. Making them needs root and iproute2 (`ip`).

A process gets onto a host in one of two ways: a command line run under `prefix(host)`
(`ip netns exec NAME ...`), or a Python child that calls `enter_netns(NAME)` first thing.
Python 3.11 has no `os.setns`, so `enter_netns` calls libc's `setns(2)` through ctypes.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")  # where `ip netns add` pins each namespace


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=30)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can (as far as can be told up front)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`, which is not on PATH"
    return None


def enter_netns(name: str) -> None:
    """Move the calling thread into namespace `name`.

    setns(2) moves only the calling thread; threads it starts afterwards inherit the namespace,
    threads that already exist stay where they were. So call it before anything opens a socket
    or starts a thread that will (an event loop's executor, a server).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name!r}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class Hosts:
    def __init__(self, count: int) -> None:
        self.tag = str(os.getpid() % 100_000)
        self.subnet = f"10.231.{os.getpid() % 200 + 20}"
        self.bridge = f"tmb{self.tag}"
        self.names = [f"tm{self.tag}-{i}" for i in range(1, count + 1)]
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index, name in enumerate(self.names, start=1):
                self._add(index, name)
        except BaseException as exc:  # half-made (an ip error, Ctrl-C): take down what exists
            self.close()
            if isinstance(exc, subprocess.CalledProcessError):
                raise RuntimeError(f"could not make network namespaces (root and iproute2 needed): "
                                   f"{(exc.stderr or '').strip()}") from exc
            raise

    def _add(self, index: int, name: str) -> None:
        _ip("netns", "add", name)
        _ip("link", "add", self._veth(index), "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("link", "set", self._veth(index), "master", self.bridge, "up")
        _ip("-n", name, "addr", "add", f"{self.subnet}.{index}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")

    def _veth(self, index: int) -> str:
        return f"tmv{self.tag}-{index}"

    @property
    def bridge_address(self) -> str:
        """The caller's own address on the hosts' subnet."""
        return f"{self.subnet}.254"

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host}"

    def prefix(self, host: int) -> tuple[str, ...]:
        """The command prefix that runs a process on `host`."""
        return ("ip", "netns", "exec", self.names[host - 1])

    def close(self) -> None:
        for index, name in enumerate(self.names, start=1):
            # deleting our end takes both ends at once; left to the namespace, they go only when
            # the kernel gets round to freeing it (and not while a process still sits in it)
            subprocess.run(["ip", "link", "del", self._veth(index)], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)

    def leftovers(self) -> list[str]:
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
        return ([n for n in self.names if n in namespaces.split()]
                + [line.split(":")[1].strip() for line in links.splitlines()
                   if self.bridge in line or f"tmv{self.tag}-" in line])
