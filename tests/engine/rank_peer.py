"""Rank 1 of a two-rank group for test_rank_group.py: `python -m tests.engine.rank_peer PORT MODE`.
MODE `exercise` runs the same collectives as the test's rank 0 and exits 0 when its own results
are right; MODE `absent` joins, then never enters a collective."""
from __future__ import annotations

import sys
import time

import torch

from tokenmill.engine.parallel.group import RankGroup
from tokenmill.engine.parallel.shm_collectives import SLOT_BYTES

SIZES = (5, 1000, SLOT_BYTES // 4 + 10)  # the last is larger than a shared slot: through gloo
MESSAGES = (b"", b"step", bytes(range(256)) * (SLOT_BYTES // 256 + 1))


def part(rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s input: integers, so every sum is exact in fp32 whatever the order."""
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + rank


def exercise(group: RankGroup) -> None:
    world, rank = group.world, group.rank
    for n in SIZES:
        assert torch.equal(group.all_reduce(part(rank, n)), sum(part(r, n) for r in range(world)))
        assert torch.equal(group.all_gather(part(rank, n)), torch.stack([part(r, n) for r in range(world)]))
        rows = world * (n // world + 1)
        mine = group.reduce_scatter(part(rank, rows).view(rows, 1))
        assert torch.equal(mine, sum(part(r, rows).view(rows, 1).chunk(world)[rank] for r in range(world)))
    for message in MESSAGES:
        assert group.broadcast_bytes(message if rank == 0 else None) == message


def main() -> int:
    port, mode = int(sys.argv[1]), sys.argv[2]
    group = RankGroup(1, 2, port)
    if mode == "absent":
        time.sleep(3600)
        return 0
    exercise(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
