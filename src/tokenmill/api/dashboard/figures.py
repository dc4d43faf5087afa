"""The dashboard's figures: what `/metrics` says over a window, from two snapshots of it.

A `Snapshot` is taken from metric families, either the frontend registry's own `collect()`
(the stream) or `/metrics` text parsed by prometheus-client (a test, a script): the same
samples, so the page shows nothing `/metrics` does not. `window(before, after)` gives:

- TTFT and ITL p50/p90: the histograms' bucket deltas (`runtime.histograms`);
- output tokens per second: the tokens the frontend sent its clients over the window;
- in flight and queued: the workers' running and waiting requests at the window's end;
- prefix-cache hits by tier: the prompt tokens the workers found on the device, and loaded
  from each tier below it (the tier's block hits x the block size), over the prompt tokens
  they looked up; prefill tokens computed and reused per second;
- cost per million output tokens (the frontend's gauge) and the workers by role and state.

Worker counters restart with their process: a counter that went down counts from zero, as
Prometheus' `rate` does, and a worker that left counts for nothing.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.runtime.histograms import quantile_between

TTFT = "tokenmill_time_to_first_token_seconds"
ITL = "tokenmill_inter_token_latency_seconds"
COST = "tokenmill_cost_per_million_tokens"
GENERATED = "tokenmill_generated_tokens_total"
WORKERS_BY_STATE = "tokenmill_workers_by_state"
TIERS = ("host", "disk", "shared")
_WORKER = "tokenmill_worker_"
_TIER = "tokenmill_worker_kv_tier_"
_WORKER_KEYS = ("num_running", "num_waiting", "queried_tokens", "device_hit_tokens", "onboarded_tokens",
                "prefill_tokens")


@dataclass(slots=True)
class Snapshot:
    t: float
    buckets: dict[str, dict[float, float]] = field(default_factory=lambda: {TTFT: {}, ITL: {}})
    workers: dict[str, dict[str, float]] = field(default_factory=dict)  # worker -> key -> value
    tier_hits: dict[tuple[str, str], float] = field(default_factory=dict)  # (worker, tier) -> blocks
    cost: float | None = None
    generated_tokens: float = 0.0
    by_state: dict[str, dict[str, int]] = field(default_factory=dict)  # role -> state -> workers


def snapshot(families: Iterable[Any], t: float) -> Snapshot:
    """The samples the figures need, from prometheus-client metric families."""
    snap = Snapshot(t)
    for family in families:
        for sample in family.samples:
            _take(snap, sample.name, sample.labels, float(sample.value))
    return snap


def _take(snap: Snapshot, name: str, labels: dict[str, str], value: float) -> None:
    for histogram in (TTFT, ITL):
        if name == histogram + "_bucket":
            bound = float(labels["le"])
            snap.buckets[histogram][bound] = snap.buckets[histogram].get(bound, 0.0) + value
            return
    if name == _TIER + "hits" and "worker" in labels:
        snap.tier_hits[(labels["worker"], labels["tier"])] = value
    elif name.startswith(_WORKER) and "worker" in labels and name[len(_WORKER):] in _WORKER_KEYS:
        snap.workers.setdefault(labels["worker"], {})[name[len(_WORKER):]] = value
    elif name == COST:
        snap.cost = value
    elif name == GENERATED:
        snap.generated_tokens = value
    elif name == WORKERS_BY_STATE:
        snap.by_state.setdefault(labels["role"], {})[labels["state"]] = int(value)


def window(before: Snapshot, after: Snapshot, block_size: int) -> dict[str, Any]:
    """The figures over (before.t, after.t]."""
    seconds = max(after.t - before.t, 1e-9)
    out: dict[str, Any] = {"t": round(after.t, 3), "window_s": round(seconds, 3)}
    for key, histogram in (("ttft", TTFT), ("itl", ITL)):
        for q in (50, 90):
            out[f"{key}_p{q}_s"] = quantile_between(q / 100, before.buckets[histogram], after.buckets[histogram])
    tokens = after.generated_tokens - before.generated_tokens
    out["output_tokens"] = tokens
    out["output_tokens_per_s"] = tokens / seconds
    out["in_flight"] = sum(w.get("num_running", 0.0) for w in after.workers.values())
    out["queued"] = sum(w.get("num_waiting", 0.0) for w in after.workers.values())
    queried, device, onboarded, computed = (_worker_delta(before, after, key) for key in
                                            ("queried_tokens", "device_hit_tokens", "onboarded_tokens",
                                             "prefill_tokens"))
    tiers = {tier: block_size * sum(_increase(before.tier_hits.get(k, 0.0), v)
                                    for k, v in after.tier_hits.items() if k[1] == tier) for tier in TIERS}
    out["prompt_tokens_looked_up"] = queried
    out["hit_rate"] = ({"device": device / queried, **{t: n / queried for t, n in tiers.items()}}
                       if queried > 0 else None)
    out["prefill_computed_tokens"], out["prefill_reused_tokens"] = computed, device + onboarded
    out["prefill_computed_per_s"] = computed / seconds
    out["prefill_reused_per_s"] = (device + onboarded) / seconds
    out["cost_per_million_tokens"] = after.cost
    out["workers"] = {role: dict(states) for role, states in sorted(after.by_state.items())}
    return out


def _worker_delta(before: Snapshot, after: Snapshot, key: str) -> float:
    return sum(_increase(before.workers.get(w, {}).get(key, 0.0), values.get(key, 0.0))
               for w, values in after.workers.items())


def _increase(old: float, new: float) -> float:
    """A counter's increase, counting from zero after a reset (a restarted worker)."""
    return new - old if new >= old else new
