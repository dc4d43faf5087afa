"""Disaggregated serving: a prefill pool and a decode pool joined by a KV-cache transfer."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.sim.memory import max_sequences
from tokenmill.sim.operators import OpContext
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.serving import MAX_UTILISATION, Workload, decode_step, kv_transfer_time, prefill_step


@dataclass(slots=True, frozen=True)
class PrefillPool:
    """Per prefill instance: latency of one batch and requests/s it sustains."""

    gpus: np.ndarray
    latency: np.ndarray  # prefill forward + KV transfer, no queueing
    service: np.ndarray  # instance-seconds per request
    fits: np.ndarray


@dataclass(slots=True, frozen=True)
class DecodePool:
    gpus: np.ndarray
    tpot: np.ndarray
    requests_per_s: np.ndarray  # per instance
    fits: np.ndarray


def prefill_pool(c: OpContext, par: Parallel, w: Workload, prompts: np.ndarray, same_domain: np.ndarray | bool = False) -> PrefillPool:
    """`prompts` per forward pass per instance (split over the attention-DP ranks)."""
    prompts = np.asarray(prompts, dtype=np.float64)
    per_rank = np.maximum(prompts / par.dp, 1.0)
    forward = prefill_step(c, par, w, per_rank)
    latency = forward + kv_transfer_time(c, w, prompts, par.gpus, np.asarray(same_domain))
    service = forward / (prompts * par.pp)  # PP keeps pp batches in flight
    cap = max_sequences(c.model, c.gpu, par, c.plan, np.full(1, w.isl))
    return PrefillPool(gpus=par.gpus, latency=latency, service=service, fits=cap >= per_rank * par.dp)


def decode_pool(c: OpContext, par: Parallel, w: Workload, batch: np.ndarray) -> DecodePool:
    batch = np.asarray(batch, dtype=np.float64)
    tpot = decode_step(c, par, w, batch / (par.dp * par.pp))
    cap = np.minimum(max_sequences(c.model, c.gpu, par, c.plan, np.full(1, w.isl + w.osl)),
                     par.dp * float(c.tuning.max_batch_per_rank))  # KV memory and the engine's decode slots
    return DecodePool(gpus=par.gpus, tpot=tpot, requests_per_s=batch / (tpot * w.osl), fits=cap >= batch)


@dataclass(slots=True, frozen=True)
class DisaggResult:
    ttft: np.ndarray
    tpot: np.ndarray
    output_tps_per_gpu: np.ndarray
    gpus: np.ndarray
    fits: np.ndarray


def rate_matched(p: PrefillPool, d: DecodePool, w: Workload, n_prefill: np.ndarray, n_decode: np.ndarray) -> DisaggResult:
    """Open-loop deployment of n_prefill + n_decode instances at the rate the slower pool sustains."""
    prefill_rate = n_prefill / p.service
    rate = np.minimum(MAX_UTILISATION * prefill_rate, n_decode * d.requests_per_s)
    rho = rate / prefill_rate
    ttft = p.latency + rho / (2 * (1 - rho)) * p.service * n_prefill
    gpus = n_prefill * p.gpus + n_decode * d.gpus
    return DisaggResult(ttft=ttft, tpot=d.tpot, output_tps_per_gpu=rate * w.osl / gpus, gpus=gpus, fits=p.fits & d.fits)


def closed_loop(c: OpContext, par: Parallel, w: Workload, n_prefill: np.ndarray, concurrency: np.ndarray,
                d_tpot: np.ndarray, same_domain: np.ndarray | bool = False) -> np.ndarray:
    """TTFT of a benchmark holding `concurrency` requests in flight (the silicon data's setting).

    Each prefill rank (attention-DP replica, pipeline slot) runs one forward over the prompts that
    arrived during its previous one, up to its token budget (`tuning.max_prefill_tokens`): at light
    load a prompt runs alone, under load forwards grow and serve more prompts each. A request waits
    for the forward in progress (M/D/1-like in the utilisation), then runs in the next one; a wave of
    requests arriving together waits behind each other's forwards (`tuning.wave_fraction`); when the
    pool saturates, Little's law bounds TTFT from below.
    """
    concurrency = np.asarray(concurrency, dtype=np.float64)
    b_max = max(float(c.tuning.max_prefill_tokens // w.isl), 1.0)
    one = prefill_pool(c, par, w, par.dp, same_domain).latency
    full = prefill_pool(c, par, w, par.dp * b_max, same_domain).latency
    slots = n_prefill * par.dp * par.pp
    rest = w.osl * d_tpot
    # Requests that arrive together (a wave) queue behind each other's batched forwards.
    wave = c.tuning.wave_fraction * np.maximum(concurrency / slots - 1.0, 0.0) / 2.0 * full / b_max
    fixed = c.tuning.ttft_overhead_s + wave
    ttft, forward = one + fixed, one
    for _ in range(30):  # fixed point of arrival rate <-> TTFT
        rate = concurrency / (ttft + rest) / slots
        batch = np.clip(rate * forward, 1.0, b_max)
        forward = one + (full - one) * (batch - 1.0) / max(b_max - 1.0, 1.0)
        rho = np.minimum(rate * forward / batch, MAX_UTILISATION)
        ttft = 0.5 * ttft + 0.5 * (forward * (1.0 + rho / (2 * (1 - rho))) + fixed)
    return np.maximum(ttft, concurrency * full / (b_max * slots) - rest)
