"""A live deployment's interval, from two scrapes of the frontend's `/metrics` (parsed by
prometheus-client's own text parser) and its `GET /admin/workers`.

Counters become per-interval deltas (a counter that went backwards means the frontend restarted:
the interval is then missing, not negative); latency quantiles come from the histogram buckets'
deltas, interpolated within a bucket as Prometheus' `histogram_quantile` does. Demand is
`tokenmill_requests_started_total` (counted at admission); ISL and OSL are the token counters
over the requests that finished; the prompt lengths' squared coefficient of variation comes
from their sum and sum of squares, and the busiest second's prompt tokens from the histogram
of prompt tokens admitted per second; the decode streams' mean and 90th percentile from the
histogram of streams sampled each second. Requests the frontend holds because no worker serves
(scaled to zero) are a gauge, read as it is now.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.planner.observation import DRAINING, SERVING, STARTING, Observation, squared_cv
from tokenmill.runtime.histograms import quantile_between

_COUNTERS = ("tokenmill_requests_started_total", "tokenmill_input_tokens_total", "tokenmill_output_tokens_total",
             "tokenmill_cached_tokens_total", "tokenmill_requests_total", "tokenmill_input_tokens_squared_total")
_HISTOGRAMS = {"ttft": "tokenmill_time_to_first_token_seconds", "itl": "tokenmill_inter_token_latency_seconds",
               "prompt_tokens_per_s": "tokenmill_prompt_tokens_per_second", "streams": "tokenmill_decode_streams"}
_LATENCIES = ("ttft", "itl")
WAITING_FOR_WORKER = "tokenmill_requests_waiting_for_worker"  # a gauge: held while no worker serves
PEAK_QUANTILE = 0.99  # of the interval's busy seconds: its busiest, within a bucket
_WORKER_STATES = {"serving": SERVING, "starting": STARTING, "draining": DRAINING}


def scrape(text: str) -> dict[str, Any]:
    """The figures the planner reads, summed over label sets: counters, histogram buckets, and
    per-worker gauges (`tokenmill_worker_kv_usage`, `tokenmill_worker_num_waiting`)."""
    out: dict[str, Any] = {name: 0.0 for name in _COUNTERS}
    buckets: dict[str, dict[float, float]] = {key: {} for key in _HISTOGRAMS}
    sums: dict[str, float] = {key: 0.0 for key in _HISTOGRAMS}
    workers: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            _take(sample, out, buckets, sums, workers)
    out["buckets"] = buckets
    out["sums"] = sums
    out["workers"] = workers
    return out


def _take(sample: Any, out: dict[str, Any], buckets: dict[str, dict[float, float]], sums: dict[str, float],
          workers: dict[str, dict[str, float]]) -> None:
    name, labels, value = sample.name, sample.labels, sample.value
    if name in _COUNTERS:
        out[name] += value
        return
    if name == WAITING_FOR_WORKER:
        out[name] = out.get(name, 0.0) + value
        return
    for key, histogram in _HISTOGRAMS.items():
        if name == histogram + "_bucket":
            bound = float(labels["le"])
            buckets[key][bound] = buckets[key].get(bound, 0.0) + value
            return
        if name == histogram + "_sum":
            sums[key] += value
            return
    if name.startswith("tokenmill_worker_") and "worker" in labels:
        workers.setdefault(labels["worker"], {})[name.removeprefix("tokenmill_worker_")] = value


def observe(before: Mapping[str, Any], after: Mapping[str, Any], at_s: float, interval_s: float,
            workers: Iterable[Mapping[str, Any]], warmup_s: float) -> Observation:
    """One interval from two `scrape`s and the `/admin/workers` list (name, role, state, started_at)."""
    obs = Observation(at_s=at_s, interval_s=interval_s)
    delta = {name: after[name] - before[name] for name in _COUNTERS}
    workers = list(workers)
    _replicas(obs, workers, at_s, warmup_s)
    if WAITING_FOR_WORKER in after:
        obs.waiting_for_worker = int(after[WAITING_FOR_WORKER])
    if any(v < 0 for v in delta.values()):
        return obs  # the frontend restarted between scrapes: nothing to say about this interval
    obs.requests = int(round(delta["tokenmill_requests_started_total"]))
    finished = delta["tokenmill_requests_total"]
    if finished > 0:
        obs.mean_isl = delta["tokenmill_input_tokens_total"] / finished
        obs.mean_osl = delta["tokenmill_output_tokens_total"] / finished
        if delta["tokenmill_input_tokens_total"] > 0:
            obs.hit_fraction = delta["tokenmill_cached_tokens_total"] / delta["tokenmill_input_tokens_total"]
        obs.isl_cv2 = squared_cv(finished, delta["tokenmill_input_tokens_total"],
                                 delta["tokenmill_input_tokens_squared_total"])
    for key in _LATENCIES:
        p50, p90 = (quantile_between(q, before["buckets"][key], after["buckets"][key]) for q in (0.5, 0.9))
        setattr(obs, f"{key}_p50_s", p50)
        setattr(obs, f"{key}_p90_s", p90)
    buckets = before["buckets"]["prompt_tokens_per_s"], after["buckets"]["prompt_tokens_per_s"]
    obs.peak_prompt_tokens_per_s = quantile_between(PEAK_QUANTILE, *buckets)
    _streams(obs, before, after)
    serving = {w["name"]: w for w in workers if w.get("state") == "serving"}
    gauges = after["workers"]
    decode_kv = [g["kv_usage"] for name, g in gauges.items() if name in serving and "kv_usage" in g
                 and serving[name].get("role") in ("decode", "agg")]
    obs.decode_kv_usage = sum(decode_kv) / len(decode_kv) if decode_kv else None
    obs.queue_depth = int(sum(g.get("num_waiting", 0.0) for name, g in gauges.items() if name in serving))
    obs.queue_depth += obs.waiting_for_worker or 0
    return obs


def _streams(obs: Observation, before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
    """The decode streams' mean over the interval's seconds (the histogram's sum ÷ count) and
    their 90th percentile."""
    samples = after["buckets"]["streams"].get(math.inf, 0.0) - before["buckets"]["streams"].get(math.inf, 0.0)
    if samples <= 0:
        return
    obs.streams_mean = (after["sums"]["streams"] - before["sums"]["streams"]) / samples
    obs.streams_p90 = quantile_between(0.9, before["buckets"]["streams"], after["buckets"]["streams"])


def _replicas(obs: Observation, workers: list[Mapping[str, Any]], at_s: float, warmup_s: float) -> None:
    for worker in workers:
        state = _WORKER_STATES.get(str(worker.get("state")))
        role = str(worker.get("role"))
        if state is None:
            continue
        obs.replicas.setdefault(role, {})
        obs.replicas[role][state] = obs.replicas[role].get(state, 0) + 1
        serving_since = worker.get("serving_since", worker.get("started_at"))
        if state == SERVING and isinstance(serving_since, (int, float)) and at_s - serving_since >= warmup_s:
            obs.warm_replicas[role] = obs.warm_replicas.get(role, 0) + 1
