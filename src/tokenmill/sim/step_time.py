"""Time of one engine step (one forward pass through every layer) for many layouts at once."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.sim.comms import allreduce_time, alltoall_time, distinct_ranks, p2p_time
from tokenmill.sim.operators import OpContext, StepShape, attention_block, dense_mlp, lm_head, moe_block
from tokenmill.sim.parallel import Parallel

ACTIVATION_BYTES = 2.0  # hidden states travel in BF16 between layers and in all-reduces


@dataclass(slots=True, frozen=True)
class StepTime:
    """Seconds per forward pass of one micro-batch through all pipeline stages."""

    compute: np.ndarray
    communication: np.ndarray
    overhead: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.compute + self.communication + self.overhead


def _moe_communication(c: OpContext, par: Parallel, s: StepShape) -> np.ndarray:
    """Attention-DP + EP uses all-to-all dispatch/combine; otherwise experts combine by all-reduce."""
    m, lat = c.model, c.tuning.latency_scale
    hidden_bytes = s.tokens * m.hidden * ACTIVATION_BYTES
    plain = allreduce_time(c.gpu, par.stage_gpus, hidden_bytes * par.dp, lat)
    sent_tokens = s.tokens / par.tp  # each attention-TP rank ships its share of the tokens
    fanout = distinct_ranks(par.ep, m.top_k)
    dispatch_bytes = sent_tokens * fanout * m.hidden * min(c.plan.activations.bytes_per_value, ACTIVATION_BYTES)
    combine_bytes = sent_tokens * fanout * m.hidden * ACTIVATION_BYTES
    a2a = alltoall_time(c.gpu, par.ep, dispatch_bytes, lat) + alltoall_time(c.gpu, par.ep, combine_bytes, lat)
    attention_tp_reduce = allreduce_time(c.gpu, par.tp, hidden_bytes, lat)
    return np.where((par.dp > 1) & (par.ep > 1), a2a + attention_tp_reduce, plain)


def step_time(c: OpContext, par: Parallel, s: StepShape, mtp_layers: int = 0) -> StepTime:
    """One forward pass: per-layer operators + collectives, LM head, pipeline hops, framework overhead.

    `mtp_layers` extra MoE layers are run for multi-token-prediction drafting.
    """
    m, lat = c.model, c.tuning.latency_scale
    hidden_bytes = s.tokens * m.hidden * ACTIVATION_BYTES
    attn_comm = allreduce_time(c.gpu, par.tp, hidden_bytes, lat)
    attn = attention_block(c, par, s)
    compute = m.layers * attn + lm_head(c, par, s)
    comm = m.layers * attn_comm
    if m.mlp_layers:
        compute = compute + m.mlp_layers * dense_mlp(c, par, s)
        comm = comm + m.mlp_layers * allreduce_time(c.gpu, par.tp, hidden_bytes, lat)
    if m.moe_layers:
        moe_layers = m.moe_layers + mtp_layers
        compute = compute + moe_layers * moe_block(c, par, s) + mtp_layers * attn
        comm = comm + moe_layers * _moe_communication(c, par, s)
    crosses = par.gpus > c.gpu.domain_size
    comm = comm + (par.pp - 1) * p2p_time(c.gpu, crosses, hidden_bytes, lat)
    return StepTime(compute=np.asarray(compute, dtype=np.float64), communication=np.asarray(comm, dtype=np.float64),
                    overhead=framework_overhead(c, s))


def framework_overhead(c: OpContext, s: StepShape) -> np.ndarray:
    """Host time per step: a fixed part (scheduling, launch) plus a part per running sequence.

    The per-sequence part (sampling, stop checks, detokenisation, block-table updates) is why measured
    TPOT keeps rising with batch after the weight reads stop growing.
    """
    seqs = s.decode_seqs + np.asarray(s.output_rows, dtype=np.float64)
    return np.asarray(c.tuning.step_overhead_s + c.tuning.seq_overhead_s * seqs, dtype=np.float64)
