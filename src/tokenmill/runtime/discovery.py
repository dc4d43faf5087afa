"""Discovery: which workers exist, where they listen, and whether they are alive.

Backends: `MemoryDiscovery` (one process, for tests), `FileDiscovery` (a registry
directory shared by processes on one host, refreshed by heartbeats) and `EtcdDiscovery`
(`etcd_discovery.py`: leases for liveness, a watched key prefix for the registry, for workers
on many hosts). All satisfy `Discovery`; `start()` and `close()` run on the event loop that
uses it (the etcd backend's background tasks; no-ops for the others).
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from tokenmill.runtime.worker_info import WorkerInfo

# How stale a worker's heartbeat may be before it counts as gone. Seconds, not one: a worker on a busy
# host can miss a beat or two while it is healthy, and dropping it migrates (or fails) its streams; a
# worker that died on this host is caught at once anyway, by its pid.
DEFAULT_TTL_S = 5.0


class Discovery(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def register(self, info: WorkerInfo) -> None: ...

    def heartbeat(self, worker_id: str, metadata: dict[str, Any] | None = None) -> None: ...

    def unregister(self, worker_id: str) -> None: ...

    def workers(self) -> list[WorkerInfo]:
        """Live workers only (heartbeat within the TTL)."""
        ...


class _NoBackgroundWork:
    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


class MemoryDiscovery(_NoBackgroundWork):
    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._workers: dict[str, WorkerInfo] = {}
        self._lock = threading.Lock()

    def register(self, info: WorkerInfo) -> None:
        with self._lock:
            info.heartbeat_at = time.time()
            self._workers[info.worker_id] = info

    def heartbeat(self, worker_id: str, metadata: dict[str, Any] | None = None) -> None:
        with self._lock:
            info = self._workers.get(worker_id)
            if info is not None:
                info.heartbeat_at = time.time()
                info.metadata.update(metadata or {})

    def unregister(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)

    def workers(self) -> list[WorkerInfo]:
        now = time.time()
        with self._lock:
            return [w for w in self._workers.values() if now - w.heartbeat_at <= self.ttl_s]


class FileDiscovery(_NoBackgroundWork):
    """One JSON file per worker in `directory`, rewritten atomically on each heartbeat."""

    def __init__(self, directory: str | Path, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ttl_s = ttl_s
        self._mine: dict[str, WorkerInfo] = {}

    def register(self, info: WorkerInfo) -> None:
        self._mine[info.worker_id] = info
        self._write(info)

    def heartbeat(self, worker_id: str, metadata: dict[str, Any] | None = None) -> None:
        info = self._mine.get(worker_id)
        if info is not None:
            info.metadata.update(metadata or {})
            self._write(info)

    def unregister(self, worker_id: str) -> None:
        self._mine.pop(worker_id, None)
        (self.directory / f"{worker_id}.json").unlink(missing_ok=True)

    def workers(self) -> list[WorkerInfo]:
        now, out = time.time(), []
        for path in self.directory.glob("*.json"):
            info = _read(path)
            if info is not None and now - info.heartbeat_at <= self.ttl_s and _pid_alive(info):
                out.append(info)
        return out

    def _write(self, info: WorkerInfo) -> None:
        info.heartbeat_at = time.time()
        tmp = self.directory / f".{info.worker_id}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(asdict(info)))
        os.replace(tmp, self.directory / f"{info.worker_id}.json")


def _read(path: Path) -> WorkerInfo | None:
    try:
        return WorkerInfo(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # being replaced, or not ours


def _pid_alive(info: WorkerInfo) -> bool:
    """On this host a dead PID means a dead worker, whatever its last heartbeat said."""
    if info.host != os.uname().nodename or info.pid <= 0:
        return True
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def discovery_from_url(url: str, ttl_s: float | None = None) -> Discovery:
    """`file:DIR`, `etcd://host:port[,host:port][/prefix]` or `memory:` (this process only);
    `ttl_s`: an etcd registration's lease (a file registry's readers judge heartbeats' age)."""
    scheme, _, rest = url.partition(":")
    if scheme == "file" and rest:
        return FileDiscovery(rest)
    if scheme == "etcd":
        from tokenmill.runtime.etcd_discovery import EtcdDiscovery, parse_etcd_url  # grpc: only when asked for

        endpoints, prefix = parse_etcd_url(url)
        return EtcdDiscovery(endpoints, prefix) if ttl_s is None else EtcdDiscovery(endpoints, prefix, ttl_s)
    if scheme == "memory":
        return MemoryDiscovery()
    raise ValueError(f"--discovery must be file:DIR, etcd://host:port[,host:port][/prefix] or memory:, got {url!r}")
