"""Completion state of one asynchronous transfer, and notification messages.

`TransferAgent.read/write` return a `TransferHandle` at once; the bytes move in a task.
`await handle.wait()` returns `TransferStatus.DONE` or `TransferStatus.FAILED` (never raises for
transport trouble); a FAILED handle carries `reason`, and its destination bytes must not be
used (they may be partly written). A transfer is DONE only when every byte arrived and, when an
expected checksum was given, the destination bytes hash to it.
"""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferError(Exception):
    """A transfer that could not complete (the reason ends up in `TransferHandle.reason`)."""


@dataclass(slots=True)
class Notification:
    """A message `sender` passed to `TransferAgent.notify` (e.g. the decode side's ACK)."""

    sender: str
    message: bytes


class TransferHandle:
    """One READ or WRITE: `op`, `peer`, chosen `backend`, `bytes` planned, then status/reason/seconds."""

    def __init__(self, op: str, peer: str, backend: str, nbytes: int, descriptors: int) -> None:
        self.op, self.peer, self.backend = op, peer, backend
        self.bytes = nbytes
        self.descriptors = descriptors  # after coalescing: copies (shm) or stream pieces (tcp)
        self.status = TransferStatus.PENDING
        self.reason: str | None = None
        self.checksum: int | None = None  # of the destination bytes, when verified
        self.seconds = 0.0
        self._started = time.perf_counter()
        self._finished = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.DONE

    def done(self) -> bool:
        return self.status is not TransferStatus.PENDING

    async def wait(self) -> TransferStatus:
        """Wait for completion; DONE or FAILED (see `reason`)."""
        await self._finished.wait()
        return self.status

    def cancel(self) -> None:
        """Stop the transfer; the handle completes FAILED with reason "cancelled"."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def complete(self, status: TransferStatus, reason: str | None = None) -> None:
        """Called once by the agent when the transfer ends."""
        if self.done():
            return
        self.status, self.reason = status, reason
        self.seconds = time.perf_counter() - self._started
        self._finished.set()

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes), once done."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __repr__(self) -> str:
        state = self.status.value if self.reason is None else f"{self.status.value}: {self.reason}"
        return f"TransferHandle({self.op} {self.bytes} B {self.backend} peer={self.peer!r} {state})"
