"""Helpers for the tier tests: a real `redis-server` on loopback, blocks to store, an event log."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from tokenmill.kv.events import BlockRemoved, BlockStored, KVEvent, KVEventEmitter
from tokenmill.kv.tiers.base import BlockMeta


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class RedisServer:
    """A redis-server child process; `stop`/`start` keep the same port so clients can reconnect."""
    workdir: Path
    port: int = field(default_factory=_free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: `apt-get install -y redis-server` (CI does it)")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    pytest.fail(f"redis-server did not come up on port {self.port}")
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


def make_block(block_hash: int, parent: int | None = None, size: int = 64) -> tuple[bytes, BlockMeta]:
    """A deterministic payload and meta for a made-up block."""
    seed = block_hash.to_bytes(8, "little")
    payload = (seed * (size // 8 + 1))[:size]
    return payload, BlockMeta(parent, tuple(range(block_hash % 7, block_hash % 7 + 4)))


class EventLog:
    """Replays tier-tagged events into per-tier sets, to compare with what the tiers hold."""

    def __init__(self, worker: str = "w0") -> None:
        self.emitter = KVEventEmitter(worker)
        self.events: list[KVEvent] = []
        self.emitter.subscribe(self.events.append)

    def holdings(self) -> dict[str, set[int]]:
        held: dict[str, set[int]] = {}
        for event in self.events:
            if isinstance(event, BlockStored):
                held.setdefault(event.tier, set()).update(event.hashes)
            elif isinstance(event, BlockRemoved):
                held.setdefault(event.tier, set()).difference_update(event.hashes)
        return held

    def ids_are_contiguous(self) -> bool:
        return [e.event_id for e in self.events] == list(range(len(self.events)))
