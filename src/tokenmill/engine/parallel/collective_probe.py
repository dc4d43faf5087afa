"""Time the collectives a parallel worker runs, on `world` rank processes of this host, for
`tokenmill sim calibrate` to fit the `cpu-local` link to: the all-reduce that ends TP and EP
block halves, and the all-gather + reduce-scatter pair of the attention-DP expert exchange.

Rank 0 runs in the calling process and starts the others as `python -m` of this module. Each
size is timed `repeats` times after one warm-up; rank 0's median is reported (it includes
waiting for the slowest peer, as a step's collectives do).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from tokenmill.engine.parallel.group import RankGroup

SIZES = (4096, 65536, 1048576, 4194304)  # bytes of fp32 per rank


@dataclass(slots=True, frozen=True)
class CollectiveTiming:
    op: str  # "all_reduce" or "exchange" (all-gather then reduce-scatter)
    nbytes: int  # per rank
    seconds: float


def measure(world: int = 2, repeats: int = 30) -> list[CollectiveTiming]:
    store = RankGroup.listen(world)
    argv = [sys.executable, "-m", __name__, "--world", str(world), "--port", str(store.port),
            "--repeats", str(repeats)]
    procs = [subprocess.Popen([*argv, "--rank", str(rank)]) for rank in range(1, world)]
    try:
        group = RankGroup(0, world, store.port, store=store)
        timings = _time_collectives(group, repeats)
        group.close()
    finally:
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"collective probe: a rank failed (exit codes {[p.returncode for p in procs]})")
    return timings


def _time_collectives(group: RankGroup, repeats: int) -> list[CollectiveTiming]:
    timings = []
    for nbytes in SIZES:
        t = torch.ones(nbytes // 4)
        for op, run in (("all_reduce", lambda: group.all_reduce(t)),
                        ("exchange", lambda: group.reduce_scatter(group.all_gather(t)))):
            run()
            seconds = []
            for _ in range(repeats):
                started = time.perf_counter()
                run()
                seconds.append(time.perf_counter() - started)
            timings.append(CollectiveTiming(op, nbytes, statistics.median(seconds)))
    return timings


def main() -> int:
    p = argparse.ArgumentParser(prog="tokenmill.engine.parallel.collective_probe")
    for name in ("--world", "--port", "--rank", "--repeats"):
        p.add_argument(name, type=int, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    _time_collectives(RankGroup(args.rank, args.world, args.port), args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
