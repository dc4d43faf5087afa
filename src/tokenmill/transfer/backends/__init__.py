"""Transfer backends. `make_backend(name)` builds one by name with default settings."""
from __future__ import annotations

from tokenmill.transfer.backends.base import Backend
from tokenmill.transfer.backends.shm import ShmBackend
from tokenmill.transfer.backends.tcp import TcpBackend

BACKEND_NAMES = ("shm", "tcp")


def make_backend(name: str) -> Backend:
    if name == "shm":
        return ShmBackend()
    if name == "tcp":
        return TcpBackend()
    raise ValueError(f"unknown transfer backend {name!r}; known: {', '.join(BACKEND_NAMES)}")


__all__ = ["BACKEND_NAMES", "Backend", "ShmBackend", "TcpBackend", "make_backend"]
