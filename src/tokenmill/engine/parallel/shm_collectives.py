"""The in-step collectives of one worker's ranks through shared memory, on one host.

Gloo over loopback costs 0.6–4 ms per collective on a small VM (each one crosses TCP and
gloo's I/O threads several times), and a decode step of a TP worker runs two per layer. Here
each rank writes its part into its own slot of a shared segment, publishes the collective's
sequence number, and waits until every rank has published it (`kernels/rank_sync.c`: a short
spin, then a futex); then each reads what it needs and sums in rank order, so every rank gets
the same bits. The gloo group stays for setup and for messages larger than a slot.

Slots are double-buffered by the sequence's parity. A rank enters collective n+1 only after
every rank published n, and a rank publishes n only after it finished reading n-1, so the
buffer n+1 writes into is free. Between wait slices a rank checks that its peers' processes
are still alive (a peer that died fails the collective instead of hanging it).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import time
import uuid
from datetime import timedelta
from functools import cache
from pathlib import Path

import numpy as np
import torch

from tokenmill.engine.kernels import load_library
from tokenmill.procs import process_alive

SLOT_BYTES = 4 << 20  # per rank and buffer; larger messages go through gloo
# bytes per rank in the header, one cache line of int64 fields: the counter (a uint32 in field 0),
# the pid, and each parity's op and size (a rank may announce collective n+1 while a slower one
# still checks n's)
HEADER_STRIDE = 64
PID, OP, SIZE = 1, 2, 3  # OP and SIZE: + 2 for odd sequence numbers
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST = 1, 2, 3, 4
SPINS = 20000  # ~0.5 ms of spinning before sleeping on the futex
SLICE_US = 100_000  # between liveness checks while waiting


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_library("rank_sync.c")
    if lib is not None:
        lib.rank_sync_publish.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.rank_sync_publish.restype = None
        lib.rank_sync_wait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint32,
                                       ctypes.c_int, ctypes.c_int]
        lib.rank_sync_wait.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None and Path("/proc").is_dir()


def segment_path() -> Path:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return root / f"tokenmill-ranks-{uuid.uuid4().hex}"


def segment_bytes(world: int) -> int:
    return world * HEADER_STRIDE + 2 * world * SLOT_BYTES


class ShmCollectives:
    """Rank `rank`'s view of the segment at `path` (rank 0 creates it, `unlink` once all are in).
    Creating raises OSError when the segment cannot be reserved (a small /dev/shm): the
    caller falls back to gloo rather than meet SIGBUS on a page tmpfs cannot back."""

    def __init__(self, path: Path, rank: int, world: int, timeout: timedelta, create: bool) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        self.path, self.seq, self.broken = path, 0, ""
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, segment_bytes(world))
            self._map = mmap.mmap(fd, segment_bytes(world))
        except OSError:
            if create:
                path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self._base = ctypes.c_char.from_buffer(self._map)
        self._address = ctypes.addressof(self._base)
        header = np.frombuffer(self._map, dtype=np.uint8, count=world * HEADER_STRIDE)
        self._header = header.view(np.int64).reshape(world, HEADER_STRIDE // 8)
        self._header[rank, PID] = os.getpid()
        self._slots = np.frombuffer(self._map, dtype=np.uint8, offset=world * HEADER_STRIDE) \
            .reshape(2, world, SLOT_BYTES)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unmap the segment, or leave that to the last tensor still viewing it."""
        if self.broken == "closed":
            return
        self.broken = "closed"
        del self._base, self._header, self._slots  # the views go first: they pin the mapping
        try:
            self._map.close()
        except BufferError:  # a result of the last collective still views the segment
            pass

    def fits(self, nbytes: int) -> bool:
        return nbytes <= SLOT_BYTES

    # ---- collectives (fp32 tensors of the same shape on every rank) ----------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t, ALL_REDUCE)
        out = parts[0].clone()
        for part in parts[1:]:
            out += part
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(t, ALL_GATHER))

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Rows [rank·n, (rank+1)·n) of the sum over ranks of `t` ([world·n, ...])."""
        parts = [p.chunk(self.world)[self.rank] for p in self._exchange(t, REDUCE_SCATTER)]
        out = parts[0].clone()
        for part in parts[1:]:
            out += part
        return out

    def broadcast_bytes(self, data: bytes | None, wait: timedelta | None) -> bytes | None:
        """Rank 0's `data` on every rank; None on all when it does not fit a slot (the caller
        sends it another way)."""
        slots = self._enter()
        if self.rank == 0:
            size = len(data or b"")
            slots[0, :8].view(np.int64)[0] = size if self.fits(size + 8) else -1
            if self.fits(size + 8):
                slots[0, 8:8 + size] = np.frombuffer(data or b"", dtype=np.uint8)
        self._publish_and_wait(wait or self.timeout, BROADCAST, -1)
        size = int(slots[0, :8].view(np.int64)[0])
        return None if size < 0 else slots[0, 8:8 + size].tobytes()

    def _exchange(self, t: torch.Tensor, op: int) -> list[torch.Tensor]:
        """Every rank's `t` (views into the segment, valid until the next collective)."""
        src = t.float().contiguous()
        nbytes = src.numel() * 4
        slots = self._enter()
        torch.from_numpy(slots[self.rank, :nbytes].view(np.float32)).copy_(src.view(-1))
        self._publish_and_wait(self.timeout, op, nbytes)
        return [torch.from_numpy(slots[r, :nbytes].view(np.float32)).view(src.shape) for r in range(self.world)]

    # ---- sequencing -----------------------------------------------------------------------------

    def _enter(self) -> np.ndarray:
        if self.broken:  # after a failure the ranks' sequences no longer line up
            raise RuntimeError(f"rank {self.rank}: the rank group is unusable ({self.broken})")
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        return self._slots[self.seq % 2]

    def _publish_and_wait(self, timeout: timedelta, op: int, nbytes: int) -> None:
        try:
            self._await_peers(timeout, op, nbytes)
        except RuntimeError as exc:
            self.broken = str(exc)
            raise

    def _await_peers(self, timeout: timedelta, op: int, nbytes: int) -> None:
        lib = _library()
        field = 2 * (self.seq % 2)
        self._header[self.rank, OP + field], self._header[self.rank, SIZE + field] = op, nbytes
        lib.rank_sync_publish(self._address + self.rank * HEADER_STRIDE, self.seq)
        deadline = time.monotonic() + timeout.total_seconds()
        while lib.rank_sync_wait(self._address, self.world, HEADER_STRIDE // 4, self.seq, SPINS, SLICE_US):
            self._check_peers()
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.rank}: collective {self.seq} timed out after {timeout}")
        ops = self._header[:, OP + field].tolist()
        sizes = [size for size in self._header[:, SIZE + field].tolist() if op != BROADCAST]
        if len(set(ops)) > 1 or len(set(sizes)) > 1:
            raise RuntimeError(f"rank {self.rank}: collective {self.seq} differs between ranks "
                               f"(ops {ops}, sizes {sizes}): the ranks are out of step")

    def _check_peers(self) -> None:
        for rank, pid in enumerate(self._header[:, PID].tolist()):
            if rank != self.rank and pid and not process_alive(pid):
                raise RuntimeError(f"rank {rank} (pid {pid}) is gone")

