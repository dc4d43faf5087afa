"""Attention data parallelism with wide expert parallelism: one forward step over every rank's
own batch.

Rank 0 keeps a scheduler and a KV pool's bookkeeping per rank (`LLMEngine.schedulers`); each step it
prepares every rank's inputs against that rank's block table and broadcasts them in one
message. Every rank then runs attention and dense layers on its own tokens and KV, and the MoE
layers through the expert exchange; a rank with nothing scheduled runs zero tokens and still
joins every exchange. The last norm's rows to sample come back to rank 0 in one all-gather,
and rank 0 applies the LM head and samples for all (the LM head's weights are read once per
step whatever the rows, so one rank doing it costs little more than each doing its own).
"""
from __future__ import annotations

from typing import Any

import torch

from tokenmill.engine.attention import AttentionBatch
from tokenmill.engine.models.transformer import CausalLM
from tokenmill.engine.parallel.expert_exchange import ExpertExchange
from tokenmill.engine.parallel.ranks import ParallelRunner
from tokenmill.engine.parallel.step_wire import Step, pack_ranks_step
from tokenmill.engine.runner_protocol import Sampled
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.kv.cache_manager import KVCacheManager


def run_rank_step(model: CausalLM, kv_cache: torch.Tensor, exchange: ExpertExchange, counts: list[int],
                  rows: list[int], step: Step) -> torch.Tensor | None:
    """This rank's share of one step; every rank's rows to sample (rank order, each padded to
    the largest count) as [ranks, rows, hidden] fp32, or None when no rank samples."""
    exchange.begin_step(counts)
    input_ids, positions, batch, logits_rows = step
    hidden = model.final_hidden(input_ids, positions, kv_cache, batch, logits_rows)
    most = max(rows)
    if not most:
        return None
    padded = torch.zeros(most, hidden.shape[1], dtype=torch.float32)
    padded[:hidden.shape[0]] = hidden
    return exchange.group.all_gather(padded)


class DataParallelRunner(ParallelRunner):
    """Rank 0's runner: `execute_ranks` runs one step of every rank's scheduler output."""

    def __init__(self, exchange: ExpertExchange, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exchange = exchange
        self.world = exchange.group.world

    def execute_ranks(self, outs: list[SchedulerOutput], kvs: list[KVCacheManager]) -> Sampled:
        """`outs[r]` scheduled on rank r's KV pool (`kvs[r]`): the tokens sampled for them all."""
        steps = [self._prepare(out, kv) for out, kv in zip(outs, kvs, strict=True)]
        sampling = [s for out in outs for s in out.seqs if s.samples]
        masks = self._start_masks(sampling)
        return self._sample(sampling, self._run(steps), masks)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """Rank 0's batch alone, the other ranks joining with nothing."""
        empty = self._empty_step()
        return self._run([(input_ids, positions, batch, logits_rows), *([empty] * (self.world - 1))])

    def _empty_step(self) -> Step:
        nothing = torch.zeros(0, dtype=torch.long)
        return nothing, nothing, AttentionBatch(nothing, [], None, self.native_prefill), nothing

    def _run(self, steps: list[Step]) -> torch.Tensor:
        """Logits (fp32) of every rank's rows to sample, in rank order."""
        counts = [len(step[0]) for step in steps]
        rows = [len(step[3]) for step in steps]
        try:
            self.ranks.send(pack_ranks_step(counts, rows, steps[1:]))
            every = run_rank_step(self.model, self.kv_cache, self.exchange, counts, rows, steps[0])
        except RuntimeError as exc:
            self.rank_lost(exc)
        if every is None:
            return torch.zeros(0, self.vocab_size)
        hidden = torch.cat([every[r, :n] for r, n in enumerate(rows)]).to(self.kv_cache.dtype)
        return self.model.logits(hidden)
