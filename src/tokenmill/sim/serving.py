"""Serving modes: aggregated (mixed continuous batching) and disaggregated (prefill + decode pools)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.sim.accounting import kv_bytes_per_token
from tokenmill.sim.memory import GB, max_sequences, memory_per_gpu, weight_bytes_per_gpu
from tokenmill.sim.operators import OpContext, StepShape, attention_block, dense_mlp
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.step_time import step_time

MAX_UTILISATION = 0.99  # queue model stops here; beyond it the capacity bound takes over
# TensorRT-LLM AttentionDpConfig.batching_wait_iters default: with ADP balance a context request
# waits up to this many iterations for the other ranks to get one (half of it on average).
ADP_BALANCE_WAIT_ITERS = 10


@dataclass(slots=True, frozen=True)
class Workload:
    isl: int
    osl: int
    mtp_tokens: int = 0  # draft tokens per step (multi-token prediction)
    mtp_acceptance: float = 1.0  # tokens emitted per decode step

    def __post_init__(self) -> None:
        if self.isl < 1 or self.osl < 1:
            raise ValueError("workload: fields isl and osl must be >= 1")
        if not 1.0 <= self.mtp_acceptance <= 1 + self.mtp_tokens:
            raise ValueError("workload: field mtp_acceptance must be in [1, 1 + mtp_tokens]")


@dataclass(slots=True, frozen=True)
class PhaseResult:
    """Arrays, one element per design point. Times in seconds."""

    ttft: np.ndarray
    tpot: np.ndarray
    output_tps_per_gpu: np.ndarray
    memory_gb_per_gpu: np.ndarray
    fits: np.ndarray
    batch_capacity: np.ndarray

    @property
    def tps_per_user(self) -> np.ndarray:
        return 1.0 / self.tpot


def decode_step(c: OpContext, par: Parallel, w: Workload, seqs_per_rank: np.ndarray, prefill_tokens: np.ndarray | float = 0.0) -> np.ndarray:
    """Seconds per token for a micro-batch of decoding sequences (optionally mixed with prefill)."""
    shape = StepShape(prefill_tokens=np.asarray(prefill_tokens, dtype=np.float64), prefill_ctx=np.full(1, w.isl / 2.0),
                      decode_seqs=np.asarray(seqs_per_rank, dtype=np.float64), decode_ctx=np.full(1, w.isl + w.osl / 2.0),
                      tokens_per_seq=1.0 + w.mtp_tokens)
    return step_time(c, par, shape, mtp_layers=w.mtp_tokens).total / w.mtp_acceptance


def prefill_step(c: OpContext, par: Parallel, w: Workload, prompts_per_rank: np.ndarray, decode_seqs: np.ndarray | float = 0.0) -> np.ndarray:
    """Seconds for one forward pass that prefills `prompts_per_rank` whole prompts per DP rank."""
    prompts = np.asarray(prompts_per_rank, dtype=np.float64)
    shape = StepShape(prefill_tokens=prompts * w.isl, prefill_ctx=np.full(1, w.isl / 2.0),
                      decode_seqs=np.asarray(decode_seqs, dtype=np.float64), decode_ctx=np.full(1, w.isl + w.osl / 2.0),
                      output_rows=prompts)
    return step_time(c.for_prefill(), par, shape).total


def queued_ttft(base: np.ndarray, service: np.ndarray, concurrency: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """Closed-loop TTFT: M/D/1 wait at the prefill server, never below Little's-law capacity bound.

    `service` is server-seconds per request, `rest` the rest of a request's life (decode).
    """
    ttft = np.array(base, dtype=np.float64)
    for _ in range(30):  # fixed point of lambda = C / (ttft + rest)
        rho = np.minimum(concurrency / (ttft + rest) * service, MAX_UTILISATION)
        ttft = 0.5 * ttft + 0.5 * (base + rho / (2 * (1 - rho)) * service)
    return np.maximum(ttft, concurrency * service - rest)


def aggregated(c: OpContext, par: Parallel, w: Workload, batch: np.ndarray, max_batch: np.ndarray | None = None) -> PhaseResult:
    """Continuous batching with chunked prefill: every step decodes the batch and prefills new prompts.

    `batch` is the number of requests in flight; `max_batch` the engine's decode-slot limit per instance
    (default: `tuning.max_batch_per_rank` per attention-DP rank). Requests beyond the KV memory bound
    queue for admission (Little's law in TTFT); requests beyond the slot limit but inside memory stay
    resident and take turns in the decode slots (TensorRT-LLM's scheduler), stretching TPOT instead.
    """
    batch = np.asarray(batch, dtype=np.float64)
    mem_cap = max_sequences(c.model, c.gpu, par, c.plan, np.full(1, w.isl + w.osl))
    slots = par.dp * float(c.tuning.max_batch_per_rank) if max_batch is None else np.asarray(max_batch, dtype=np.float64)
    resident = np.maximum(np.minimum(batch, mem_cap), 1.0)
    live = np.maximum(np.minimum(resident, slots), 1.0)
    per_rank = live / par.dp
    micro = per_rank / par.pp
    # Steady state: a request finishes every osl/acceptance steps, so its prompt is spread over them.
    step = decode_step(c, par, w, micro) + c.tuning.prefill_in_tpot * _interleaved_prefill(c, par, w, micro)
    tpot = step * resident / live
    # The first token also waits out engine iterations it does not compute in (admission at a step
    # boundary, output processing behind the overlapped next step, streaming): `tuning.ttft_steps`.
    ttft0 = _agg_first_token(c, par, w, per_rank, micro) + c.tuning.ttft_steps * step
    if c.tuning.adp_balance:
        ttft0 = ttft0 + np.where(par.dp > 1, 0.5 * ADP_BALANCE_WAIT_ITERS * step, 0.0)
    life = ttft0 + w.osl * tpot
    ttft = ttft0 + life * np.maximum(batch / np.maximum(mem_cap, 1.0) - 1.0, 0.0)  # Little's law queue when over memory
    tps_gpu = resident * w.osl / life / par.gpus
    mem = memory_per_gpu(c.model, par, c.plan, resident / par.dp * (w.isl + w.osl)) / GB
    fits = (mem_cap >= batch) & (slots >= batch) & (weight_bytes_per_gpu(c.model, par, c.plan) < c.gpu.hbm_gb * GB)
    return PhaseResult(ttft=ttft, tpot=tpot, output_tps_per_gpu=tps_gpu, memory_gb_per_gpu=mem, fits=fits,
                       batch_capacity=np.minimum(mem_cap, slots))


def _interleaved_prefill(c: OpContext, par: Parallel, w: Workload, micro: np.ndarray) -> np.ndarray:
    """Extra seconds per decode step from the prompt chunks mixed into it, at the prefill kernels' efficiency.

    In steady state a request finishes every osl/acceptance steps, so its prompt is spread over them.
    A user's tokens are slowed only by the *other* requests' prompts: its own prefill is its TTFT,
    before its first decode step (at batch 1 the decode steps carry no prefill at all).
    """
    cp = c.for_prefill()
    others = np.maximum(micro - 1.0 / par.dp, 0.0)  # the other requests, per attention-DP rank
    rate = others * w.mtp_acceptance / w.osl  # their prompts per step per rank
    mean = decode_step(cp, par, w, micro, rate * w.isl) - decode_step(cp, par, w, micro)
    if c.tuning.adp_balance:
        return mean
    return mean + _busiest_rank_excess(cp, par, w, micro, rate)


def _busiest_rank_excess(c: OpContext, par: Parallel, w: Workload, micro: np.ndarray, rate: np.ndarray) -> np.ndarray:
    """Attention-DP: the per-rank layers (attention, dense MLP) wait for the rank with the most prompt tokens.

    The MoE layers see every rank's tokens, so they cost the mean; attention runs per rank and
    the step waits for the busiest one (TensorRT-LLM tech blog 10, "ADP Balance Strategy": the
    iteration time is dominated by the slowest rank; balancing is opt-in).
    """
    busiest = busiest_rank_arrivals(rate, par.dp) * w.isl
    ctx, dctx = np.full(1, w.isl / 2.0), np.full(1, w.isl + w.osl / 2.0)

    def per_rank_layers(tokens: np.ndarray) -> np.ndarray:
        s = StepShape(np.asarray(tokens, dtype=np.float64), ctx, micro, dctx)
        dense = dense_mlp(c, par, s) * c.model.mlp_layers if c.model.mlp_layers else 0.0
        return attention_block(c, par, s) * c.model.layers + dense

    return np.where(par.dp > 1, per_rank_layers(busiest) - per_rank_layers(rate * w.isl), 0.0)


def busiest_rank_arrivals(rate: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Expected prompts per step on the busiest of `ranks` attention-DP ranks, each getting Poisson(`rate`).

    Attention-DP ranks step together (their MoE layers are one collective), so a step lasts as long
    as its busiest rank: a prompt's prefill landing on one rank stalls the others. With one rank this
    is the mean; with many ranks and rare arrivals it tends to P(any rank has one) = 1 - exp(-rate*ranks).
    E[max] = sum over k >= 1 of 1 - F(k-1)^ranks, F the Poisson CDF.
    """
    lam = np.maximum(np.asarray(rate, dtype=np.float64), 0.0)
    n = np.asarray(ranks, dtype=np.float64)
    terms = int(np.ceil(np.max(lam, initial=0.0) + 10.0 * np.sqrt(np.max(lam, initial=0.0)) + 10.0))
    pmf = np.exp(-lam)  # P(N = 0)
    cdf = pmf.copy()
    expected = np.zeros(np.broadcast(lam, n).shape)
    for k in range(1, terms + 1):
        expected = expected + 1.0 - cdf ** n  # P(max >= k)
        pmf = pmf * lam / k
        cdf = cdf + pmf
    return np.where(n > 1, expected, lam)


def _agg_first_token(c: OpContext, par: Parallel, w: Workload, per_rank: np.ndarray, micro: np.ndarray) -> np.ndarray:
    """Prefill of a request's prompt in token-budget chunks, behind the share of its wave that queues first."""
    waiting_tokens = w.isl * (1.0 + c.tuning.wave_fraction * (per_rank - 1.0) / 2.0)
    chunk = np.minimum(waiting_tokens, c.tuning.max_prefill_tokens)
    chunk_time = step_time(c.for_prefill(), par, StepShape(chunk, np.full(1, w.isl / 2.0), micro, np.full(1, w.isl + w.osl / 2.0),
                                             output_rows=np.maximum(chunk / w.isl, 1.0))).total
    steps = np.ceil(waiting_tokens / c.tuning.max_prefill_tokens)
    return chunk_time * (1.0 + (steps - 1.0) / par.pp) + c.tuning.ttft_overhead_s


def kv_transfer_time(c: OpContext, w: Workload, prompts: np.ndarray, prefill_gpus: np.ndarray, same_domain: np.ndarray) -> np.ndarray:
    """Moving the prompts' KV from the prefill instance to the decode instance."""
    nbytes = prompts * w.isl * kv_bytes_per_token(c.model, c.plan.kv.bytes_per_value, w.isl)
    bw = np.where(same_domain, c.gpu.nvlink_bw, c.gpu.scaleout_bw) * c.gpu.link_eff * prefill_gpus
    return c.gpu.collective_latency_s + nbytes / bw
