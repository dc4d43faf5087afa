"""A worker's rank group (`engine/parallel/group.py`): the same exact results through shared
memory and through gloo (and past a shared slot), sums in rank order whatever their size, no
segment left in /dev/shm, and a peer that dies mid-collective fails it instead of hanging it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.engine.rank_peer import exercise, sums_in_rank_order
from tokenmill.engine.parallel import shm_collectives
from tokenmill.engine.parallel.group import RankGroup

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def two_ranks(mode: str) -> Iterator[tuple[RankGroup, subprocess.Popen]]:
    store = RankGroup.listen(2)
    peer = subprocess.Popen([sys.executable, "-m", "tests.engine.rank_peer", str(store.port), mode], cwd=ROOT)
    try:
        yield RankGroup(0, 2, store.port, store=store), peer
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "gloo"])
def test_every_rank_gets_the_exact_results(shared_memory: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not shared_memory:
        monkeypatch.setenv("TOKENMILL_DISABLE_KERNELS", "1")  # the peer inherits it
    shm_collectives._library.cache_clear()
    try:
        before = set(Path("/dev/shm").glob("tokenmill-ranks-*"))
        with two_ranks("exercise") as (group, peer):
            assert (group.shm is not None) == shared_memory
            assert set(Path("/dev/shm").glob("tokenmill-ranks-*")) == before  # unlinked once mapped
            exercise(group)
            assert peer.wait(timeout=60) == 0
    finally:
        shm_collectives._library.cache_clear()


def test_sums_are_in_rank_order_whatever_their_size_with_three_ranks() -> None:
    """What a row of a --deterministic --tp 3 worker needs: its partial sums add up the same in a
    long prompt chunk's tensor (past a shared slot) as in a decode step's."""
    store = RankGroup.listen(3)
    peers = [subprocess.Popen([sys.executable, "-m", "tests.engine.rank_peer", str(store.port), "order", "3", str(r)],
                              cwd=ROOT) for r in (1, 2)]
    try:
        group = RankGroup(0, 3, store.port, store=store)
        assert group.shm is not None
        sums_in_rank_order(group)
        assert [p.wait(timeout=60) for p in peers] == [0, 0]
    finally:
        for p in peers:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_a_peer_killed_during_a_collective_fails_it() -> None:
    with two_ranks("absent") as (group, peer):
        assert group.shm is not None
        os.kill(peer.pid, signal.SIGKILL)  # not reaped: a zombie still answers kill(pid, 0)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="gone"):
            group.all_reduce(torch.ones(4))
        assert time.monotonic() - started < 10
