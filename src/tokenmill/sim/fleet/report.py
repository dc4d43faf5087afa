"""Totals of a fleet simulation: latency percentiles, SLA attainment, goodput, cost and energy.

- SLA attainment: the share of *all* requests (rejected ones count as misses) whose TTFT and
  mean ITL are both within the targets; goodput is those requests per second of the run. The
  TTFT and ITL miss shares say which target the misses broke (a request may break both).
- GPU-hours: every replica from its creation (GPUs are held while it starts) to its retirement.
- Cost per million output tokens: GPU-hours × price per GPU-hour ÷ output tokens × 10⁶.
- Energy: each GPU draws its catalog power (`power_w`) while its replica steps and
  `IDLE_POWER_FRACTION` of it otherwise (an assumption: idle H100/B200 boards draw ~10-25% of
  their rated power); kWh, and joules per output token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenmill.sim.fleet.config import FleetConfig
from tokenmill.sim.fleet.fleet import FleetSim
from tokenmill.sim.fleet.records import RequestRecord

IDLE_POWER_FRACTION = 0.2
SCHEMA = "tokenmill.sim.fleet/1"


def _percentiles(values: list[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_p{q}": None for q in (50, 90, 99)}
    arr = np.asarray(values, dtype=np.float64)
    return {f"{prefix}_p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}


@dataclass(slots=True)
class FleetResult:
    config: FleetConfig
    records: list[RequestRecord]
    totals: dict[str, object] = field(default_factory=dict)
    intervals: list[dict[str, object]] = field(default_factory=list)
    changes: list[dict[str, object]] = field(default_factory=list)

    def to_json(self, per_request: bool = True) -> dict[str, object]:
        out: dict[str, object] = {"schema": SCHEMA, "deployment": describe_deployment(self.config),
                                  "totals": self.totals, "intervals": self.intervals, "changes": self.changes}
        if per_request:
            out["requests"] = [r.to_json() for r in self.records]
        return out


def describe_deployment(config: FleetConfig) -> dict[str, object]:
    return {"agg": config.agg, "prefill": config.prefill, "decode": config.decode, "router": config.router,
            "profiles": {role: p.describe() for role, p in config.profiles.items()},
            "ttft_target_s": config.sla.ttft_s, "itl_target_s": config.sla.itl_s,
            "replica_startup_s": config.replica_startup_s, "block_size": config.block_size,
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "disagg_threshold_tokens": config.disagg.threshold_tokens, "seed": config.seed}


def summarize(sim: FleetSim, since_s: float = 0.0) -> FleetResult:
    """The run's totals; from `since_s` on, only the requests arriving then or later and the
    GPU-time after it (GPU-hours, cost) count, so a planner's warm-up is left out of the score.
    Energy, peak GPUs, the disaggregation decisions and the intervals stay the whole run's."""
    config = sim.config
    records = sorted((r for r in sim.records.values() if r.arrival_s >= since_s), key=lambda r: (r.arrival_s, r.request_id))
    served = [r for r in records if r.finished]
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.last_token_s or r.arrival_s for r in records), default=start)
    makespan = max(end - start, 1e-9)  # from the first arrival to the last token
    ttfts = [r.ttft_s for r in served if r.ttft_s is not None]
    itls = [r.itl_mean_s for r in served if r.itl_mean_s is not None]
    within = [r for r in served if (r.ttft_s or 0.0) <= config.sla.ttft_s
              and (r.itl_mean_s is None or r.itl_mean_s <= config.sla.itl_s)]
    output_tokens = sum(r.tokens for r in served)
    totals: dict[str, object] = {
        "requests": len(records), "finished": len(served), "rejected": len(records) - len(served),
        "duration_s": makespan, "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / makespan,
        "cached_fraction": sum(r.cached_tokens for r in served) / max(sum(r.input_tokens for r in served), 1),
        **_percentiles(ttfts, "ttft_s"), **_percentiles(itls, "itl_mean_s"),
        **_percentiles([r.itl_max_s for r in served if r.tokens > 1], "itl_max_s"),
        **_percentiles([r.e2e_s for r in served if r.e2e_s is not None], "e2e_s"),
        "itl_mean_s": float(np.mean(itls)) if itls else None,
        "sla_attainment": len(within) / len(records) if records else 0.0,
        "ttft_miss_share": sum(1 for r in served if (r.ttft_s or 0.0) > config.sla.ttft_s) / max(len(records), 1),
        "itl_miss_share": sum(1 for r in served if r.itl_mean_s is not None and r.itl_mean_s > config.sla.itl_s)
        / max(len(records), 1),
        "goodput_requests_per_s": len(within) / makespan,
        "preemptions": sum(r.preemptions for r in records),
        "disagg_decisions": dict(sorted((f"{d}/{why}", n) for (d, why), n in sim.policy.counts.items())),
    }
    totals.update(_cost_and_energy(sim, max(sim.now, end), output_tokens, since_s))
    return FleetResult(config, records, totals, [i.to_json() for i in sim.intervals],
                       [c.to_json() for c in sim.change_log])


def _cost_and_energy(sim: FleetSim, end_s: float, output_tokens: int, since_s: float = 0.0) -> dict[str, object]:
    gpu_seconds = joules = 0.0
    for replica in sim.replicas.values():
        life = max((replica.gone_s if replica.gone_s is not None else end_s) - max(replica.created_s, since_s), 0.0)
        power = replica.clock.context.gpu.power_w * replica.gpus
        busy = min(replica.busy_s, life)
        gpu_seconds += life * replica.gpus
        joules += power * (busy + IDLE_POWER_FRACTION * (life - busy))
    gpu_hours = gpu_seconds / 3600.0
    cost = gpu_hours * sim.config.usd_per_gpu_hour
    peak = max([i.gpus for i in sim.intervals] + [sum(r.gpus for r in sim.replicas.values() if r.created_s == 0.0)])
    return {"gpu_hours": gpu_hours, "peak_gpus": peak, "cost_usd": cost,
            "usd_per_million_output_tokens": cost / output_tokens * 1e6 if output_tokens else None,
            "energy_kwh": joules / 3.6e6, "joules_per_output_token": joules / output_tokens if output_tokens else None}


def run_fleet(config: FleetConfig, requests, progress=None) -> FleetResult:
    """Simulate `requests` over the fleet `config` describes."""
    sim = FleetSim(config)
    sim.progress = progress
    sim.run(requests)
    return summarize(sim)
