"""The planner's Prometheus series: what it runs, what it expects, and how often it decided what.

`tokenmill_planner_replicas{role}` (the target), `tokenmill_planner_predicted_requests`,
`..._predicted_isl_tokens`, `..._predicted_osl_tokens`, `..._expected_ttft_seconds`,
`..._expected_itl_seconds`, `tokenmill_planner_decisions_total{kind}` (scale_up, scale_down,
fast_scale_up, cold_start, no_change, held_missing, held_sustain, limited) and
`tokenmill_planner_gpu_hours_total` (from the intervals' decisions: a fast-path or cold-start
decision's short window lies within an interval that counts it already).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenmill.planner.decision import Decision


def decision_kind(decision: Decision) -> str:
    if decision.held:
        return "held_missing"
    if decision.path == "fast":
        return "fast_scale_up"
    if decision.path == "cold-start":
        return "cold_start"
    if any(a.delta > 0 for a in decision.actions):
        return "scale_up"
    if any(a.delta < 0 for a in decision.actions):
        return "scale_down"
    if any("holding" in c for c in decision.constraints):
        return "held_sustain"
    if decision.constraints:
        return "limited"
    return "no_change"


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry, gpus_per_replica: dict[str, int]) -> None:
        self.gpus = gpus_per_replica
        self.replicas = Gauge("tokenmill_planner_replicas", "replicas the planner targets", ["role"], registry=registry)
        self.requests = Gauge("tokenmill_planner_predicted_requests", "requests forecast for the next interval",
                              registry=registry)
        self.isl = Gauge("tokenmill_planner_predicted_isl_tokens", "forecast mean prompt tokens", registry=registry)
        self.osl = Gauge("tokenmill_planner_predicted_osl_tokens", "forecast mean output tokens", registry=registry)
        self.ttft = Gauge("tokenmill_planner_expected_ttft_seconds", "TTFT the model expects at the target",
                          registry=registry)
        self.itl = Gauge("tokenmill_planner_expected_itl_seconds", "ITL the model expects at the target",
                         registry=registry)
        self.decisions = Counter("tokenmill_planner_decisions", "planner decisions by kind", ["kind"],
                                 registry=registry)
        self.gpu_hours = Counter("tokenmill_planner_gpu_hours", "GPU-hours of the replicas present, as observed",
                                 registry=registry)

    def record(self, decision: Decision) -> None:
        self.decisions.labels(kind=decision_kind(decision)).inc()
        for role, n in decision.target.items():
            self.replicas.labels(role=role).set(n)
        if decision.forecast:
            self.requests.set(decision.forecast["requests"])
            self.isl.set(decision.forecast["isl"])
            self.osl.set(decision.forecast["osl"])
        if decision.expected_ttft_s is not None:
            self.ttft.set(decision.expected_ttft_s)
        if decision.expected_itl_s is not None:
            self.itl.set(decision.expected_itl_s)
        if decision.path not in ("fast", "cold-start"):
            present = sum(n * self.gpus.get(role, 1) for role, n in decision.current.items())
            self.gpu_hours.inc(present * decision.observed.interval_s / 3600.0)
