"""The ranks of one worker as a gloo process group on loopback, and the collectives the
forward pass needs: all-reduce of partial sums, rank 0's step broadcast as bytes, and (wide
EP under attention DP) all-gather and reduce-scatter of equal-sized row blocks.

Each worker makes its own group object (a TCPStore on a free port, `ProcessGroupGloo` on
127.0.0.1) instead of torch.distributed's process-wide default group, so several engines can
live in one process (the tests do) and nothing global is mutated. A collective waits at most
`timeout`: a rank whose peer died raises instead of hanging.

The collectives themselves go through shared memory when the native rank sync builds
(`shm_collectives.py`, ~100× less latency than gloo over loopback here), and sum in rank
order: sums larger than a slot go through it a slot at a time. Gloo carries the setup and
all-gathers larger than a slot (and everything where the rank sync does not build).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tokenmill.engine.parallel import shm_collectives
from tokenmill.engine.parallel.shm_collectives import ShmCollectives

DEFAULT_TIMEOUT = timedelta(seconds=60)
IDLE_WAIT = timedelta(days=7)  # a follower between steps: bounded only by its peers' liveness
SHM_KEY = "tokenmill/shm"

log = logging.getLogger(__name__)


class RankGroup:
    def __init__(self, rank: int, world: int, port: int, timeout: timedelta = DEFAULT_TIMEOUT,
                 store: dist.TCPStore | None = None) -> None:
        """Rank 0 passes the store it created (`listen`); the others connect to `port`."""
        self.rank, self.world = rank, world
        self.store = store or dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = timeout
        self.group = dist.ProcessGroupGloo(self.store, rank, world, options)
        self.shm = self._attach_shared_memory(timeout)
        self.collective_seconds = 0.0  # wall time in all-reduces and step broadcasts (benchmarks)

    def _attach_shared_memory(self, timeout: timedelta) -> ShmCollectives | None:
        """Rank 0 makes the segment and names it in the store ("" for none: gloo carries
        everything); once every rank has mapped it, or failed to, its name goes (the mappings
        stay), so nothing is left behind a crash. Raises RuntimeError when a rank cannot join."""
        if self.rank != 0:
            return self._join_shared_memory(timeout)
        shm = None
        if shm_collectives.available():
            try:
                shm = ShmCollectives(shm_collectives.segment_path(), 0, self.world, timeout, create=True)
            except OSError as exc:
                log.warning("rank collectives through gloo only: no shared segment (%s)", exc)
        self.store.set(SHM_KEY, str(shm.path) if shm else "")
        try:
            self.group.barrier().wait()
        finally:
            if shm is not None:
                shm.unlink()
        return shm

    def _join_shared_memory(self, timeout: timedelta) -> ShmCollectives | None:
        name = self.store.get(SHM_KEY).decode()
        if name and not shm_collectives.available():
            raise RuntimeError(f"rank {self.rank}: rank 0 uses shared-memory collectives, and this rank "
                               "cannot build the native rank sync")
        try:
            return ShmCollectives(Path(name), self.rank, self.world, timeout, create=False) if name else None
        finally:
            self.group.barrier().wait()

    def close(self) -> None:
        """Unmap the shared segment; the group is unusable after this."""
        if self.shm is not None:
            self.shm.close()

    @staticmethod
    def listen(world: int, timeout: timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
        """Rank 0's store on a free loopback port (`.port`), made before the other ranks start."""
        return dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, summed in fp32 (gloo has no bf16 sum) and returned in t's dtype."""
        return self._collective(t, "all_reduce", self._gloo_all_reduce).to(t.dtype)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (same shape on all), stacked in rank order, in fp32."""
        return self._collective(t, "all_gather", self._gloo_all_gather)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Rows [rank·n, (rank+1)·n) of the sum over ranks of `t` ([world·n, ...]), in fp32."""
        return self._collective(t, "reduce_scatter", self._gloo_reduce_scatter)

    def _collective(self, t: torch.Tensor, name: str,
                    gloo: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Through shared memory when `t` fits a slot (the same answer on every rank: the shapes
        agree), a sum larger than a slot through shared memory slot by slot, else through gloo;
        timed for `collective_seconds`."""
        started = time.perf_counter()
        if self.shm is not None and self.shm.fits(t.numel() * 4):
            out = getattr(self.shm, name)(t)
        elif self.shm is not None and name != "all_gather":
            out = self._sum_by_slots(t, name)
        else:
            out = gloo(t.float().contiguous())
        self.collective_seconds += time.perf_counter() - started
        return out

    def _sum_by_slots(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """The all-reduce (or reduce-scatter) of a `t` larger than a slot, a slot's worth at a time:
        every element summed in rank order, as in one slot. (Gloo's ring would start each part of
        the tensor at another rank, so an element's sum would follow the tensor's size: a row of a
        long prompt chunk would differ in its last bits from the same row in a decode step.)"""
        flat, step = t.reshape(-1), shm_collectives.SLOT_BYTES // 4
        total = torch.cat([self.shm.all_reduce(flat[i:i + step]) for i in range(0, flat.numel(), step)])
        total = total.view(t.shape)
        return total if name == "all_reduce" else total.chunk(self.world)[self.rank].clone()

    def _gloo_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([t]).wait()
        return t

    def _gloo_all_gather(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self.group.allgather([parts], [t]).wait()
        return torch.stack(parts)

    def _gloo_reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        parts = [p.contiguous() for p in t.chunk(self.world)]
        out = torch.empty_like(parts[0])
        self.group.reduce_scatter([out], [parts]).wait()
        return out

    def broadcast_bytes(self, data: bytes | None, wait: timedelta | None = None) -> bytes:
        """Rank 0 sends `data`; every rank returns it. `wait` replaces the group's timeout for
        the first message (a follower idles there between steps; a peer that dies still fails
        it: its connection closes, or its process is found gone between shared-memory waits)."""
        started = time.perf_counter()
        if self.shm is not None:
            message = self.shm.broadcast_bytes(data, wait)
            if message is not None:
                self.collective_seconds += time.perf_counter() - started
                return message
            wait = None  # every rank is here already: too large a message follows through gloo
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self.group.broadcast(size, 0, wait).wait()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 and data \
            else torch.empty(int(size.item()), dtype=torch.uint8)
        if buf.numel():
            self.group.broadcast(buf, 0).wait()
        self.collective_seconds += time.perf_counter() - started
        return buf.numpy().tobytes()
