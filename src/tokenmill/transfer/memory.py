"""Memory an agent can move bytes from and to: registered regions and shared-memory buffers.

A `MemoryRegion` is a named, flat, writable byte range an agent registers; descriptors
(`tokenmill.transfer.descriptors`) address bytes inside it by (region name, offset, length).
Kinds:

- `host`: ordinary process memory (a CPU tensor, a bytearray); only byte-stream backends
  (tcp) can reach it from another process.
- `shm`: a file in the shared-memory directory (`/dev/shm`), created by its owner with
  `SharedBuffer.create` and mapped by a same-host peer with `SharedBuffer.attach`, so the peer
  copies straight out of (or into) it.
- `cuda`: reserved for device memory backends (CUDA IPC, NCCL, UCX).

`allocate_shared_tensor(shape, dtype)` puts a torch tensor (the engine's KV pool) in shared
memory; its `.region(name)` is what the agent registers. The creator owns the file: `close()`
unlinks it (and a finalizer does so at interpreter exit), attachers only unmap.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

REGION_KINDS = ("host", "shm", "cuda")
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
SHM_PREFIX = "tokenmill-"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


@dataclass(slots=True)
class MemoryRegion:
    """A registered byte range: `buffer` is a flat writable uint8 memoryview over it."""

    name: str
    kind: str
    buffer: memoryview
    shm_name: str | None = None  # the shared-memory file a peer maps, for kind "shm"

    def __post_init__(self) -> None:
        if self.kind not in REGION_KINDS:
            raise ValueError(f"region {self.name!r}: kind must be one of {REGION_KINDS}, got {self.kind!r}")
        if self.buffer.readonly or self.buffer.format != "B" or self.buffer.ndim != 1:
            raise ValueError(f"region {self.name!r}: buffer must be a flat writable byte view")
        if (self.kind == "shm") != (self.shm_name is not None):
            raise ValueError(f"region {self.name!r}: shm_name is required for, and only for, kind 'shm'")

    @property
    def length(self) -> int:
        return self.buffer.nbytes

    def describe(self) -> dict[str, Any]:
        """What a peer needs to address this region (msgpack-able; no local pointers)."""
        return {"kind": self.kind, "length": self.length, "shm_name": self.shm_name}


def byte_view(obj: Any) -> memoryview:
    """A flat writable uint8 view of a buffer (bytearray, numpy array, mmap, CPU tensor)."""
    if hasattr(obj, "data_ptr"):  # a torch tensor: go through numpy (bfloat16 has no buffer protocol)
        if obj.device.type != "cpu" or not obj.is_contiguous():
            raise ValueError("only contiguous CPU tensors can be registered as host memory")
        obj = obj.reshape(-1).view(_uint8_dtype()).numpy()
    return memoryview(obj).cast("B")


def host_region(name: str, obj: Any) -> MemoryRegion:
    """A `host` region over a process-private buffer or CPU tensor."""
    return MemoryRegion(name, "host", byte_view(obj))


def _uint8_dtype() -> Any:
    import torch

    return torch.uint8


class SharedBuffer:
    """A named file in the shared-memory directory, mapped read-write into this process."""

    def __init__(self, shm_name: str, length: int, *, owner: bool, populate: bool = False) -> None:
        if not _SAFE_NAME.match(shm_name):
            raise ValueError(f"shared-memory name {shm_name!r} must match {_SAFE_NAME.pattern}")
        if length <= 0:
            raise ValueError(f"shared-memory length must be positive, got {length}")
        self.shm_name, self.length, self.owner = shm_name, length, owner
        self.path = SHM_DIR / shm_name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if owner:
                os.ftruncate(fd, length)
            elif os.fstat(fd).st_size < length:
                raise ValueError(f"shared memory {shm_name!r} holds {os.fstat(fd).st_size} bytes, "
                                 f"the peer announced {length}")
            # populate pre-faults the whole mapping (and allocates every page of a sparse file)
            extra = mmap.MAP_POPULATE if populate and hasattr(mmap, "MAP_POPULATE") else 0
            self._mmap: mmap.mmap | None = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | extra)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap).cast("B")
        # the creator's file must not outlive it, even if close() is never called
        self._unlinker = weakref.finalize(self, _unlink_quietly, self.path) if owner else None

    @classmethod
    def create(cls, length: int, shm_name: str | None = None) -> SharedBuffer:
        return cls(shm_name or private_shm_name(), length, owner=True)

    @classmethod
    def attach(cls, shm_name: str, length: int, populate: bool = False) -> SharedBuffer:
        """Map a peer's buffer. Lazily by default: a KV pool is mostly untouched, and a
        populated mapping would allocate all of it (and block the event loop doing so)."""
        return cls(shm_name, length, owner=False, populate=populate)

    def close(self) -> None:
        """Unmap (when no view is still exported) and, for the creator, unlink the file."""
        if self._unlinker is not None:
            self._unlinker()
        if self._mmap is None:
            return
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:  # a tensor or numpy view still uses the pages; the unmap goes with it
            log.debug("shared memory %s still has views; leaving the unmap to them", self.shm_name)
        self._mmap = None

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


@dataclass(slots=True)
class SharedTensor:
    """A torch tensor whose storage is a `SharedBuffer` (e.g. the engine's KV pool)."""

    tensor: torch.Tensor
    shared: SharedBuffer

    def region(self, name: str) -> MemoryRegion:
        """The `shm` region to register with a `TransferAgent`."""
        return MemoryRegion(name, "shm", self.shared.view, shm_name=self.shared.shm_name)

    def close(self) -> None:
        self.shared.close()


def allocate_shared_tensor(shape: tuple[int, ...], dtype: torch.dtype, shm_name: str | None = None) -> SharedTensor:
    """A zero-filled tensor of `shape`/`dtype` in shared memory that a same-host peer can map."""
    import torch

    numel = 1
    for dim in shape:
        if dim <= 0:
            raise ValueError(f"shape {shape} must have positive dimensions")
        numel *= dim
    length = numel * torch.empty((), dtype=dtype).element_size()
    shared = SharedBuffer.create(length, shm_name)
    # through numpy, not torch.frombuffer: numpy holds a buffer export, so the pages cannot be
    # unmapped under a live tensor (close() then leaves the unmap to the last view)
    flat = torch.from_numpy(np.frombuffer(shared.view, dtype=np.uint8))  # a new file reads as zeros
    return SharedTensor(flat.view(dtype).view(shape), shared)


def private_shm_name(suffix: str = "") -> str:
    """A fresh shared-memory file name carrying this process's pid, so whoever outlives a
    killed process can remove what it left (`remove_shared_files_of`)."""
    return f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}{suffix}"


def remove_shared_files_of(pid: int) -> int:
    """Unlink the shared-memory files a dead process created (a SIGKILL skips its finalizers);
    returns how many. Peers that still map one keep their mapping until they unmap it."""
    removed = 0
    for path in SHM_DIR.glob(f"{SHM_PREFIX}{pid}-*"):
        _unlink_quietly(path)
        removed += 1
    return removed


def shm_domain() -> str:
    """Two processes with equal domains see the same shared-memory files (same boot, same mount)."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = os.uname().nodename
    stat = os.stat(SHM_DIR)
    return f"{boot_id}:{stat.st_dev}:{stat.st_ino}"
