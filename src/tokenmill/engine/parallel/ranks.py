"""Rank 0's side of a parallel worker: it starts ranks 1..N-1 as processes
(`python -m tokenmill.engine.parallel.follower`), joins their gloo group, and broadcasts each
step's inputs before running its own share of the forward pass (`ParallelRunner`).

Ownership: rank 0 keeps the scheduler, the KV bookkeeping, sampling and the worker's socket;
the other ranks hold only their weight shards and their KV heads, and follow. A rank that dies
makes the collective every other rank waits in raise (its process is found gone, or its gloo
connection closes; the group's timeout bounds the rest), a follower then exits, and the worker
fails as a whole instead of hanging.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch

from tokenmill.engine.attention import AttentionBatch
from tokenmill.engine.models.layers import GatedMLP
from tokenmill.engine.models.moe import SparseMoE
from tokenmill.engine.models.transformer import Attention, CausalLM
from tokenmill.engine.parallel.expert_exchange import ExpertExchange
from tokenmill.engine.parallel.group import DEFAULT_TIMEOUT, RankGroup
from tokenmill.engine.parallel.shard import ParallelLayout, Shard
from tokenmill.engine.parallel.step_wire import STOP, pack_step
from tokenmill.engine.runner import TorchModelRunner

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class RankSpec:
    """What a follower needs to build its shard: the same for every rank but `rank`."""
    model: str
    dtype: str
    layout: ParallelLayout
    num_blocks: int
    block_size: int
    max_positions: int
    threads: int
    deterministic: bool = False

    def argv(self, rank: int, port: int, timeout: timedelta) -> list[str]:
        return [sys.executable, "-m", "tokenmill.engine.parallel.follower", "--model", self.model,
                "--dtype", self.dtype, "--tp", str(self.layout.tp), "--ep", str(self.layout.ep),
                "--attention-dp", str(self.layout.dp),
                "--rank", str(rank), "--port", str(port), "--num-blocks", str(self.num_blocks),
                "--block-size", str(self.block_size), "--max-positions", str(self.max_positions),
                "--threads", str(self.threads), "--timeout-s", str(timeout.total_seconds()),
                *(["--deterministic"] if self.deterministic else [])]


def attach_collectives(model: CausalLM, shard: Shard, group: RankGroup) -> ExpertExchange | None:
    """Every module whose output is a partial sum on this rank ends in the group's all-reduce;
    under attention DP the MoE layers exchange tokens instead (the exchange is returned)."""
    if shard.layout.dp > 1:
        exchange = ExpertExchange(group)
        for module in model.modules():
            if isinstance(module, SparseMoE):
                module.exchange = exchange
        return exchange
    for module in model.modules():
        if (isinstance(module, Attention) and shard.attention_split) \
                or (isinstance(module, GatedMLP) and shard.mlp_split) \
                or (isinstance(module, SparseMoE) and shard.moe_split):
            module.reduce = group.all_reduce
    return None


class RankProcesses:
    """Ranks 1..N-1 as child processes, and rank 0's membership of their group. An engine
    dropped without `close()` still takes its ranks with it (they would otherwise idle, each
    holding its weights, while this process lives)."""

    def __init__(self, spec: RankSpec, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        world = spec.layout.world
        store = RankGroup.listen(world, timeout)
        self.procs = [subprocess.Popen(spec.argv(rank, store.port, timeout)) for rank in range(1, world)]
        weakref.finalize(self, _kill, self.procs)
        try:
            self.group = RankGroup(0, world, store.port, timeout, store=store)
        except BaseException:
            _kill(self.procs)
            raise

    def send(self, message: bytes) -> None:
        self.group.broadcast_bytes(message)

    def stop(self) -> None:
        """Tell the ranks to exit, and wait for them (killed if they do not)."""
        try:
            self.send(STOP)
        except RuntimeError as exc:  # a rank already gone: the rest fail their next collective
            log.warning("parallel ranks: stop not delivered (%s)", exc)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.group.close()

    def kill(self) -> None:
        _kill(self.procs)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


EXIT_RANK_LOST = 70


class ParallelRunner(TorchModelRunner):
    """Rank 0's runner: each forward pass is broadcast to the other ranks first.

    A failed collective means a rank is gone: the worker cannot compute another step. With
    `exit_on_rank_loss` (worker processes) the process exits at once, so that the frontend
    migrates its streams and the supervisor restarts it whole; otherwise step() raises."""

    def __init__(self, ranks: RankProcesses, *args, exit_on_rank_loss: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ranks = ranks
        self.exit_on_rank_loss = exit_on_rank_loss

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                logits_rows: torch.Tensor) -> torch.Tensor:
        try:
            self.ranks.send(pack_step(input_ids, positions, batch, logits_rows))
            return super().forward(input_ids, positions, batch, logits_rows)
        except RuntimeError as exc:
            self.rank_lost(exc)

    def rank_lost(self, exc: RuntimeError) -> NoReturn:
        """A collective failed: raise it again, or exit the process (`exit_on_rank_loss`)."""
        if not self.exit_on_rank_loss:
            raise exc
        log.critical("a rank of this worker is gone (%s); exiting so the worker restarts whole", exc)
        self.ranks.kill()
        os._exit(EXIT_RANK_LOST)

    def close(self) -> None:
        self.ranks.stop()
