"""What one replica sustains inside the latency targets, from the simulator's step-time model.

No profiling run: the same `StepClock` that prices simulated steps and clocks mock workers
gives, for a replica of the deployment's model, GPU, precision and layout:

- **prefill**: the prompt tokens per second it computes at full chunks (`max_num_batched_tokens`
  per step), and the time one prompt of the mean ISL takes alone (its chunks back to back). A
  pool kept at utilisation ρ has a mean queue wait of ρ/(1 − ρ) · v · S for service time S,
  where v = (ca² + cs²)/2 holds the squared coefficients of variation of the gaps between
  arrivals and of the service times (Kingman's G/G/1 approximation; Poisson arrivals of equal
  prompts, M/D/1, give v = ½). The SLA is per request, so the wait that matters is the tail's,
  taken as TAIL_FACTOR (ln 100: an exponential tail's 99th percentile) times the mean. TTFT ≤
  target then holds for ρ ≤ k / (1 + k) with k = x / (TAIL_FACTOR · v) and x = (target − S) / S;
  the replica's capacity is that share of its full-chunk rate (the planner passes v from the
  observed prompt spread; bursts it handles apart, `planner/load_shape.LoadShape`).
- **decode**: the largest batch whose step, at a mean context of ISL + OSL/2, stays within
  DECODE_ITL_HEADROOM of the ITL target and whose KV fits the replica's cache; capacity is that
  batch ÷ its step time, in output tokens per second. The headroom is there because the SLA
  is per request: a pool run at a step of exactly the target misses it for every stream whose
  batch holds longer contexts than the mean (and long outputs, staying longest, make the
  time-average context of a batch longer than ISL + OSL/2).

`ReplicaModel.capacity(isl, osl)` returns both with the numbers behind them, so a decision can
say why a replica counts for what it counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.sim.fleet.clock import StepClock
from tokenmill.step_work import StepWork

MAX_PREFILL_UTILISATION = 0.9  # beyond this a queue's wait explodes with any burst
MIN_PREFILL_UTILISATION = 0.05  # when one prompt alone misses the target: still a number to plan with
KV_HEADROOM = 0.9  # decode batches are sized to 90% of the KV cache (preemption beyond)
DECODE_ITL_HEADROOM = 0.9  # ... and to a step of 90% of the ITL target
TAIL_FACTOR = math.log(100.0)  # p99 wait / mean wait, for an exponential tail
POISSON_VARIABILITY = 0.5  # (ca² + cs²)/2 for Poisson arrivals of equal prompts (M/D/1)


@dataclass(slots=True, frozen=True)
class Capacity:
    """One replica's sustainable rates at the targets, and the figures they come from."""
    prefill_tokens_per_s: float  # uncached prompt tokens per second, at the TTFT target
    prefill_peak_tokens_per_s: float  # at full chunks, no latency bound
    prefill_alone_s: float  # one prompt of the mean ISL, alone
    prefill_utilisation: float  # the share of the peak the TTFT target allows
    decode_tokens_per_s: float  # output tokens per second, at the ITL target
    decode_batch: int  # the batch that gives it
    decode_step_s: float  # that batch's step time
    ttft_feasible: bool  # one prompt alone fits the TTFT target
    itl_feasible: bool  # one sequence alone fits the ITL target
    mixed_step_s: float = 0.0  # a full prefill chunk beside the decode batch: what an aggregated
    # replica's streams wait while it prefills


class ReplicaModel:
    """The step-time model of one replica profile, asked for capacities at the SLA."""

    def __init__(self, clock: StepClock, ttft_s: float, itl_s: float, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, kv_tokens: int | None = None) -> None:
        if ttft_s <= 0 or itl_s <= 0:
            raise ValueError("the TTFT and ITL targets must be > 0")
        self.clock = clock
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.max_num_seqs = max_num_seqs
        self.chunk = max_num_batched_tokens
        self.kv_tokens = kv_tokens if kv_tokens is not None else clock.kv_capacity_tokens()
        self._full_chunk_rate: float | None = None

    @property
    def gpus(self) -> int:
        return self.clock.profile.gpus

    def prefill_seconds(self, tokens: int, context_before: int = 0) -> float:
        """One prompt's uncached `tokens` computed alone, chunk after chunk."""
        total, done = 0.0, 0
        while done < tokens:
            n = min(self.chunk, tokens - done)
            start = context_before + done
            total += self.clock.seconds(StepWork(prefill_tokens=n, prefill_attended=StepWork.chunk_attended(start, n),
                                                 prefill_kv_tokens=start + n, sampled=1 if done + n == tokens else 0))
            done += n
        return total

    def full_chunk_tokens_per_s(self) -> float:
        """Prompt tokens per second at full chunks of fresh prompts: the rate at which a backlog
        of prompts is cleared (a step batches several short ones into one chunk)."""
        if self._full_chunk_rate is None:
            self._full_chunk_rate = self.chunk / self.prefill_seconds(self.chunk)
        return self._full_chunk_rate

    def decode_step_seconds(self, batch: int, context: float) -> float:
        return self.clock.seconds(StepWork(decode_seqs=batch, decode_kv_tokens=int(batch * context), sampled=batch))

    def capacity(self, isl: float, osl: float, hit_fraction: float = 0.0,
                 variability: float = POISSON_VARIABILITY) -> Capacity:
        uncached = max(1, round(isl * (1.0 - min(max(hit_fraction, 0.0), 1.0))))
        cached = max(0, round(isl) - uncached)
        alone = self.prefill_seconds(uncached, cached)
        chunk = min(self.chunk, max(uncached, 1))
        peak = chunk / self.prefill_seconds(chunk, cached)
        feasible = alone < self.ttft_s
        if feasible:
            k = (self.ttft_s - alone) / alone / (TAIL_FACTOR * max(variability, 1e-3))
            rho = min(MAX_PREFILL_UTILISATION, k / (1 + k))
        else:
            rho = MIN_PREFILL_UTILISATION
        batch, step = self._decode_batch(isl + osl / 2.0)
        mixed = self.clock.seconds(StepWork(
            prefill_tokens=chunk, prefill_attended=StepWork.chunk_attended(cached, chunk), prefill_kv_tokens=cached + chunk,
            decode_seqs=batch, decode_kv_tokens=int(batch * (isl + osl / 2.0)), sampled=batch + 1))
        return Capacity(prefill_tokens_per_s=rho * peak, prefill_peak_tokens_per_s=peak, prefill_alone_s=alone,
                        prefill_utilisation=rho, decode_tokens_per_s=batch / step, decode_batch=batch,
                        decode_step_s=step, ttft_feasible=feasible,
                        itl_feasible=self.decode_step_seconds(1, isl) <= self.itl_s, mixed_step_s=mixed)

    def _decode_batch(self, context: float) -> tuple[int, float]:
        """The largest batch within the ITL budget and the KV cache (at least 1), and its step time."""
        budget = self.itl_s * DECODE_ITL_HEADROOM
        kv_limit = max(1, math.floor(self.kv_tokens * KV_HEADROOM / max(context, 1.0)))
        high = max(1, min(self.max_num_seqs, kv_limit))
        low = 1
        if self.decode_step_seconds(high, context) <= budget:
            low = high
        else:
            while high - low > 1:  # step time grows with the batch: bisect for the last one in budget
                mid = (low + high) // 2
                if self.decode_step_seconds(mid, context) <= budget:
                    low = mid
                else:
                    high = mid
        return low, self.decode_step_seconds(low, context)

    def step_at_throughput(self, tokens_per_s: float, context: float) -> float:
        """The decode step time of the smallest batch that reaches `tokens_per_s` (what the ITL
        should be when a replica carries that load)."""
        low, high = 1, max(1, self.max_num_seqs)
        if high / self.decode_step_seconds(high, context) < tokens_per_s:
            return self.decode_step_seconds(high, context)
        while high - low > 1:
            mid = (low + high) // 2
            if mid / self.decode_step_seconds(mid, context) >= tokens_per_s:
                high = mid
            else:
                low = mid
        batch = low if low / self.decode_step_seconds(low, context) >= tokens_per_s else high
        return self.decode_step_seconds(batch, context)

    def expected_ttft(self, isl: float, hit_fraction: float, utilisation: float,
                      variability: float = POISSON_VARIABILITY) -> float:
        """Mean TTFT of a prefill pool at `utilisation` of its peak (Kingman's wait plus service)."""
        uncached = max(1, round(isl * (1.0 - hit_fraction)))
        alone = self.prefill_seconds(uncached, max(0, round(isl) - uncached))
        return alone + queue_wait(alone, utilisation, variability)


def queue_wait(service_s: float, utilisation: float, variability: float) -> float:
    """Kingman's mean wait of a G/G/1 queue: ρ/(1 − ρ) · (ca² + cs²)/2 · S (ρ capped at 0.99)."""
    rho = min(max(utilisation, 0.0), 0.99)
    return rho / (1 - rho) * variability * service_s
