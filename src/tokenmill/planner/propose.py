"""Replicas wanted per pool: from the forecast and the performance model (sla), from the
latency and KV signals (load), or both (hybrid: the forecast's number as a floor, the signals
above it).

sla, disaggregated ("rate matching": the prefill:decode ratio follows the ISL/OSL mix):
  prefill = ⌈rate × ISL × (1 − hit) ÷ a prefill replica's tokens/s at the TTFT target⌉
  decode  = ⌈rate × OSL ÷ a decode replica's tokens/s at the ITL target⌉
sla, aggregated: one pool whose replicas split their time, ⌈prefill share + decode share⌉.
A replica's capacity is divided by the observed/expected latency ratio of its pool (bounded
to [1/MAX_CORRECTION, MAX_CORRECTION], and only once a replica of that pool is past its warm-up).
A prefill replica's capacity also shrinks with how spread the recent prompt lengths were (the v
of the performance model's queue), and the prefill pool never drops below what clears the
busiest recent second's prompt tokens within the TTFT target beside the mean load
(`LoadShape`; a clairvoyant forecast brings the coming one instead). A decode pool (or an
aggregated pool's decode share) is sized for its streams' recent peaks above their mean, not
the mean alone (`LoadShape.stream_peak_ratio`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.planner.flags import MODES
from tokenmill.planner.hold import LevelHold
from tokenmill.planner.load_shape import LoadShape
from tokenmill.planner.observation import SERVING, Observation
from tokenmill.planner.perf_model import MAX_PREFILL_UTILISATION, Capacity, ReplicaModel, queue_wait

MAX_CORRECTION = 1.5
KV_HIGH, KV_LOW = 0.85, 0.40  # load mode: decode KV use that adds / allows removing a replica
BURST_WINDOW_S = 1.0  # bursts are measured as the busiest second's prompt tokens


class Forecast(Protocol):
    requests: float
    isl: float
    osl: float
    peak_prompt_tokens_per_s: float | None  # known only to a clairvoyant forecast; else from history


@dataclass(slots=True)
class Proposal:
    replicas: dict[str, int]
    reasons: list[str] = field(default_factory=list)
    expected_ttft_s: float | None = None
    expected_itl_s: float | None = None
    inputs: dict[str, Any] = field(default_factory=dict)  # the numbers behind it, for the record


class Corrections:
    """Observed/expected latency per pool, smoothed and bounded; 1.0 until a warm replica reports."""

    def __init__(self, smoothing: float = 0.5) -> None:
        self.smoothing = smoothing
        self.ratio: dict[str, float] = {}

    def update(self, role: str, observed: float | None, expected: float | None, warm: int) -> None:
        if not warm or not observed or not expected:
            return
        raw = min(max(observed / expected, 1 / MAX_CORRECTION), MAX_CORRECTION)
        old = self.ratio.get(role, 1.0)
        self.ratio[role] = old + self.smoothing * (raw - old)

    def of(self, role: str) -> float:
        return self.ratio.get(role, 1.0)


class Proposer:
    def __init__(self, models: dict[str, ReplicaModel], disaggregated: bool, mode: str = "sla",
                 burst_quantile: float | None = None, hold: LevelHold | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"--planner mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.models = models
        self.disaggregated = disaggregated
        self.mode = mode
        self.corrections = Corrections()
        self.shape = LoadShape(burst_quantile=burst_quantile)
        self.hold = hold  # the forecast's number held at the recent level (sla and hybrid); None: as proposed

    def targets(self) -> tuple[float, float]:
        """(TTFT, ITL) targets in seconds."""
        model = next(iter(self.models.values()))
        return model.ttft_s, model.itl_s

    @property
    def roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.disaggregated else ("agg",)

    def propose(self, forecast: Forecast, obs: Observation) -> Proposal:
        self.shape.update(obs)
        self._correct(obs)
        if self.mode == "load":
            return self.reactive(obs)
        proposal = self.predictive(forecast, obs)
        if self.hold is not None:
            unheld = proposal.replicas[self.roles[0]]
            proposal.replicas, held = self.hold.apply(proposal.replicas)
            proposal.reasons += held
            if proposal.replicas[self.roles[0]] != unheld:  # the model's TTFT was for the unheld count
                proposal.expected_ttft_s = None
        if self.mode == "hybrid":
            reactive = self.reactive(obs)
            for role, n in reactive.replicas.items():
                if n > proposal.replicas[role]:
                    proposal.replicas[role] = n
                    proposal.reasons.append(f"{role}: signals ask for {n} above the forecast's number")
        return proposal

    def predictive(self, forecast: Forecast, obs: Observation) -> Proposal:
        rate = max(forecast.requests, 0.0) / obs.interval_s
        hit = obs.hit_fraction or 0.0
        isl, osl = max(forecast.isl, 1.0), max(forecast.osl, 1.0)
        inputs: dict[str, Any] = {"rate_per_s": rate, "isl": isl, "osl": osl, "hit_fraction": hit,
                                  "variability": self.shape.variability()}
        known = forecast.peak_prompt_tokens_per_s  # a clairvoyant forecast's; otherwise the recent past's
        peak = self.shape.peak_tokens_per_s() if known is None else known
        inputs["burst_from"] = "recent intervals" if known is None else "the coming intervals"
        if self.disaggregated:
            return self._disaggregated(rate, isl, osl, hit, peak, inputs)
        return self._aggregated(rate, isl, osl, hit, peak, inputs)

    def _disaggregated(self, rate: float, isl: float, osl: float, hit: float, peak: float,
                       inputs: dict[str, Any]) -> Proposal:
        p_cap = self._capacity("prefill", isl, osl, hit)
        d_cap = self._capacity("decode", isl, osl, hit)
        p_need = rate * isl * (1 - hit) / (p_cap.prefill_tokens_per_s / self.corrections.of("prefill"))
        peaks = self.shape.stream_peak_ratio()
        d_need = rate * osl * peaks / (d_cap.decode_tokens_per_s / self.corrections.of("decode"))
        burst_need = self._burst_need("prefill", rate * isl, hit, peak) * self.corrections.of("prefill")
        replicas = {"prefill": math.ceil(max(p_need, burst_need) - 1e-9), "decode": math.ceil(d_need - 1e-9)}
        inputs.update(prefill_need=max(p_need, burst_need), decode_need=d_need, prefill_burst_need=burst_need,
                      stream_peak_ratio=peaks,
                      prefill_capacity=_capacity_json(p_cap), decode_capacity=_capacity_json(d_cap),
                      corrections=dict(self.corrections.ratio))
        reasons = [f"prefill: {rate:.2f} req/s x {isl:.0f} ISL x {1 - hit:.2f} uncached / "
                   f"{p_cap.prefill_tokens_per_s:,.0f} tok/s per replica ({p_cap.prefill_utilisation:.0%} of its peak "
                   f"at queue variability {self.shape.variability():.2f} from the prompts' spread) = {p_need:.2f}",
                   f"decode: {rate:.2f} req/s x {osl:.0f} OSL x {peaks:.2f} (the streams' peaks over their mean) / "
                   f"{d_cap.decode_tokens_per_s:,.0f} tok/s per replica (batch {d_cap.decode_batch}) = {d_need:.2f}"]
        if burst_need > p_need:
            reasons.append(self._burst_reason("prefill", peak, burst_need, inputs))
        reasons += _infeasible(p_cap, "prefill") + _infeasible(d_cap, "decode")
        return Proposal(replicas, reasons, *self._expected(p_cap, d_cap, p_need, replicas["prefill"]), inputs)

    def _burst_need(self, role: str, mean_tokens_per_s: float, hit: float, peak: float) -> float:
        """Replicas whose full-chunk rate clears a busiest second of `peak` prompt tokens within
        the TTFT target while the mean load goes on: the excess E = A − λ of a one-second burst
        over the mean rate λ is cleared by what the pool has beyond λ, so R ≥ λ + E / (TTFT + ½ s)
        (the burst's last arrival then waits TTFT − ½ s, leaving ½ s for its own prefill)."""
        model = self.models[role]
        mean, burst = mean_tokens_per_s * (1 - hit), peak * (1 - hit)
        if burst <= 0:
            return 0.0
        rate = mean + max(burst - mean, 0.0) / (model.ttft_s + BURST_WINDOW_S / 2)
        return rate / (model.full_chunk_tokens_per_s() * MAX_PREFILL_UTILISATION)

    def _burst_reason(self, role: str, peak: float, need: float, inputs: dict[str, Any]) -> str:
        return (f"{role}: the busiest second of {inputs['burst_from']} brings {peak:,.0f} prompt tokens; "
                f"clearing it within the TTFT target takes {need:.2f} replicas")

    def _aggregated(self, rate: float, isl: float, osl: float, hit: float, peak: float,
                    inputs: dict[str, Any]) -> Proposal:
        cap = self._capacity("agg", isl, osl, hit)
        correction = max(self.corrections.of("agg"), self.corrections.of("agg:itl"))  # the slower side binds
        mean_share = rate * isl * (1 - hit) / cap.prefill_tokens_per_s
        burst_share = self._burst_need("agg", rate * isl, hit, peak)
        prefill_share = max(mean_share, burst_share)
        peaks = self.shape.stream_peak_ratio()
        decode_share = rate * osl * peaks / cap.decode_tokens_per_s
        need = (prefill_share + decode_share) * correction
        inputs.update(prefill_share=prefill_share, decode_share=decode_share, stream_peak_ratio=peaks, need=need,
                      capacity=_capacity_json(cap), corrections=dict(self.corrections.ratio))
        reasons = [f"agg: {rate:.2f} req/s needs {prefill_share:.2f} replicas of prefill time and "
                   f"{decode_share:.2f} of decode time (streams peaking at {peaks:.2f}x their mean; "
                   f"x{correction:.2f} observed) = {need:.2f}"]
        if burst_share > mean_share:
            reasons.append(self._burst_reason("agg", peak, burst_share, inputs))
        reasons += _infeasible(cap, "agg")
        if cap.mixed_step_s > self.models["agg"].itl_s:
            reasons.append(f"agg: a step with a full prefill chunk takes {cap.mixed_step_s * 1e3:.0f} ms, over the "
                           f"ITL target: streams miss it whenever their replica prefills; more replicas do not "
                           "fix that (disaggregate, or a smaller --max-num-batched-tokens)")
        replicas = {"agg": math.ceil(need - 1e-9)}
        return Proposal(replicas, reasons, *self._expected(cap, cap, prefill_share, replicas["agg"]), inputs)

    def _expected(self, p_cap: Capacity, d_cap: Capacity, p_need: float, p_replicas: int) -> tuple[float, float]:
        utilisation = p_need * p_cap.prefill_utilisation / p_replicas if p_replicas else 0.0
        ttft = p_cap.prefill_alone_s + queue_wait(p_cap.prefill_alone_s, utilisation, self.shape.variability())
        return ttft, d_cap.decode_step_s

    def reactive(self, obs: Observation) -> Proposal:
        """±1 per pool from its signals: queue time and TTFT for prefill, KV use and ITL for decode."""
        targets = {role: self.models[role] for role in self.roles}
        replicas, reasons = {}, []
        for role in self.roles:
            current = obs.count(role)
            delta, why = self._signal(role, obs, targets[role])
            replicas[role] = max(current + delta, 0)
            if why:
                reasons.append(f"{role}: {why}; {current} -> {replicas[role]}")
        return Proposal(replicas, reasons)

    def _signal(self, role: str, obs: Observation, model: ReplicaModel) -> tuple[int, str]:
        if role in ("prefill", "agg"):
            if obs.queue_time_s is not None and obs.queue_time_s > model.ttft_s / 2:
                return 1, f"queue time {obs.queue_time_s * 1e3:.0f} ms > half the TTFT target"
            if obs.ttft_p90_s is not None and obs.ttft_p90_s > model.ttft_s:
                return 1, f"TTFT p90 {obs.ttft_p90_s * 1e3:.0f} ms > target {model.ttft_s * 1e3:.0f} ms"
        if role in ("decode", "agg"):
            if obs.decode_kv_usage is not None and obs.decode_kv_usage > KV_HIGH:
                return 1, f"decode KV {obs.decode_kv_usage:.0%} > {KV_HIGH:.0%}"
            if obs.itl_p90_s is not None and obs.itl_p90_s > model.itl_s:
                return 1, f"ITL p90 {obs.itl_p90_s * 1e3:.1f} ms > target {model.itl_s * 1e3:.1f} ms"
        quiet = (obs.queue_depth or 0) == 0 and (obs.decode_kv_usage or 0.0) < KV_LOW \
            and (obs.ttft_p90_s or 0.0) < model.ttft_s / 2 and (obs.itl_p90_s or 0.0) < model.itl_s * 0.8
        return (-1, "latency well inside the targets and KV below 40%") if quiet else (0, "")

    def _capacity(self, role: str, isl: float, osl: float, hit: float) -> Capacity:
        return self.models[role].capacity(isl, osl, hit, self.shape.variability())

    def _correct(self, obs: Observation) -> None:
        """Fold this interval's observed/expected latencies into the corrections (warm replicas
        only): expected is the model's latency at the load each serving replica carried."""
        if obs.mean_isl is None or obs.mean_osl is None or not obs.requests:
            return
        hit = obs.hit_fraction or 0.0
        rate = obs.requests / obs.interval_s
        for role in self.roles:
            model, serving = self.models[role], obs.count(role, SERVING)
            warm = obs.warm_replicas.get(role, 0)
            if not serving:
                continue
            if role in ("prefill", "agg"):
                cap = model.capacity(obs.mean_isl, obs.mean_osl, hit)
                load = rate * obs.mean_isl * (1 - hit) / (serving * cap.prefill_peak_tokens_per_s)
                expected = model.expected_ttft(obs.mean_isl, hit, load, self.shape.variability())
                self.corrections.update(role, obs.ttft_p50_s, expected, warm)
            if role in ("decode", "agg"):
                step = model.step_at_throughput(rate * obs.mean_osl / serving, obs.mean_isl + obs.mean_osl / 2)
                self.corrections.update(role + ":itl" if role == "agg" else role, obs.itl_p50_s, step, warm)


def _infeasible(cap: Capacity, role: str) -> list[str]:
    out = []
    if not cap.ttft_feasible and role != "decode":
        out.append(f"{role}: one prompt alone takes {cap.prefill_alone_s * 1e3:.0f} ms, over the TTFT target")
    if not cap.itl_feasible and role != "prefill":
        out.append(f"{role}: one sequence's step is over the ITL target")
    return out


def _capacity_json(cap: Capacity) -> dict[str, Any]:
    return {name: getattr(cap, name) for name in cap.__slots__}  # type: ignore[attr-defined]
