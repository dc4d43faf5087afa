"""A peer rank for test_rank_group.py: `python -m tests.engine.rank_peer PORT MODE [WORLD RANK]`
(default: rank 1 of 2). MODE `exercise` runs the same collectives as the test's rank 0 and exits
0 when its own results are right; `order` does the same for `sums_in_rank_order`; `absent`
joins, then never enters a collective."""
from __future__ import annotations

import sys
import time

import torch

from tokenmill.engine.parallel.group import RankGroup
from tokenmill.engine.parallel.shm_collectives import SLOT_BYTES

SIZES = (5, 1000, SLOT_BYTES // 4 + 10)  # the last is larger than a shared slot
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


def sums_in_rank_order(group: RankGroup) -> None:
    """Sums of random fp32 parts, in and past one shared slot, are the parts added in rank order:
    what the same element adds up to in any other tensor (gloo's ring starts each part of a
    tensor at another rank, which rounds differently with three ranks or more)."""
    world, rank = group.world, group.rank
    for n in (1000, 3 * (SLOT_BYTES // 4) + 10):
        parts = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        ordered = parts[0].clone()
        for p in parts[1:]:
            ordered += p
        assert torch.equal(group.all_reduce(parts[rank]), ordered), n
        rows = n // world * world
        mine = group.reduce_scatter(parts[rank][:rows].view(rows, 1))
        assert torch.equal(mine, ordered[:rows].view(rows, 1).chunk(world)[rank]), n


def main() -> int:
    port, mode = int(sys.argv[1]), sys.argv[2]
    world, rank = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (2, 1)
    group = RankGroup(rank, world, port)
    if mode == "absent":
        time.sleep(3600)
        return 0
    (sums_in_rank_order if mode == "order" else exercise)(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
