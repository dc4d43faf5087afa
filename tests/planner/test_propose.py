"""Proposal arithmetic: hand-computed replica counts, rate matching with the real step-time model,
the reactive signals, and the observed/expected correction (bounded, warm replicas only)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from tokenmill.planner.load_shape import MAX_STREAM_PEAK_RATIO, LoadShape
from tokenmill.planner.observation import SERVING, Observation
from tokenmill.planner.perf_model import DECODE_ITL_HEADROOM, Capacity, ReplicaModel
from tokenmill.planner.propose import MAX_CORRECTION, Proposer
from tokenmill.sim.fleet.clock import StepClock


@dataclass
class Load:
    requests: float
    isl: float
    osl: float
    peak_prompt_tokens_per_s: float | None = None


class FixedModel:
    """A replica with known capacities: 10,000 prompt tok/s at the TTFT target, 2,000 output tok/s."""
    ttft_s, itl_s, gpus = 1.0, 0.05, 4

    def capacity(self, isl: float, osl: float, hit_fraction: float = 0.0, variability: float = 0.5) -> Capacity:
        return Capacity(10_000.0, 12_000.0, 0.2, 0.8, 2_000.0, 64, 0.032, True, True)

    def expected_ttft(self, isl: float, hit: float, utilisation: float, variability: float = 0.5) -> float:
        return 0.2

    def step_at_throughput(self, tokens_per_s: float, context: float) -> float:
        return 0.032


def _obs(**fields) -> Observation:
    return Observation(at_s=30.0, interval_s=30.0, **fields)


def test_disaggregated_counts_by_hand() -> None:
    proposer = Proposer({"prefill": FixedModel(), "decode": FixedModel()}, disaggregated=True)  # type: ignore[dict-item]
    # 300 requests in 30 s = 10 req/s; 10 x 4,000 x (1 - 0.25) = 30,000 tok/s -> 3 prefill;
    # 10 x 500 = 5,000 output tok/s -> 2.5 -> 3 decode
    proposal = proposer.propose(Load(300, 4000, 500), _obs(hit_fraction=0.25))
    assert proposal.replicas == {"prefill": 3, "decode": 3}
    assert proposal.inputs["prefill_need"] == pytest.approx(3.0)
    assert proposal.inputs["decode_need"] == pytest.approx(2.5)
    assert any(r.startswith("prefill: 10.00 req/s") for r in proposal.reasons)


def test_decode_is_sized_for_the_streams_peaks_over_their_mean() -> None:
    """The seconds' p90 of streams ran at 1.5x, 1.2x and 1.5x their means in the last intervals:
    the decode pool is sized at their median, 10 x 500 x 1.5 / 2,000 = 3.75 -> 4 (the mean alone: 3)."""
    proposer = Proposer({"prefill": FixedModel(), "decode": FixedModel()}, disaggregated=True)  # type: ignore[dict-item]
    proposer.propose(Load(300, 4000, 500), _obs(hit_fraction=0.25, streams_mean=400.0, streams_p90=600.0))
    proposer.propose(Load(300, 4000, 500), _obs(hit_fraction=0.25, streams_mean=500.0, streams_p90=600.0))
    proposal = proposer.propose(Load(300, 4000, 500), _obs(hit_fraction=0.25, streams_mean=400.0, streams_p90=600.0))
    assert proposal.replicas == {"prefill": 3, "decode": 4}
    assert proposal.inputs["decode_need"] == pytest.approx(3.75)
    assert any("x 1.50 (the streams' peaks" in r for r in proposal.reasons)
    # aggregated: the decode share grows alike, 1.0 + 10 x 300 x 1.5 / 2,000 = 3.25 -> 4
    agg = Proposer({"agg": FixedModel()}, disaggregated=False)  # type: ignore[dict-item]
    agg.propose(Load(300, 1000, 300), _obs(streams_mean=100.0, streams_p90=150.0))
    assert agg.propose(Load(300, 1000, 300), _obs()).replicas == {"agg": 4}


def test_aggregated_replicas_split_their_time() -> None:
    proposer = Proposer({"agg": FixedModel()}, disaggregated=False)  # type: ignore[dict-item]
    # prefill share 10 x 1,000 / 10,000 = 1.0, decode share 10 x 300 / 2,000 = 1.5 -> 2.5 -> 3
    assert proposer.propose(Load(300, 1000, 300), _obs()).replicas == {"agg": 3}
    assert proposer.propose(Load(0, 1000, 300), _obs()).replicas == {"agg": 0}  # zero traffic


def test_rate_matching_long_prompts_raise_the_prefill_share() -> None:
    clock = StepClock.from_text("llama-3.1-70b@h100:fp8:tp4")
    model = ReplicaModel(clock, ttft_s=1.0, itl_s=0.05)
    proposer = Proposer({"prefill": model, "decode": model}, disaggregated=True)
    short = proposer.predictive(Load(600, 500, 300), _obs()).inputs
    long = proposer.predictive(Load(600, 8000, 300), _obs()).inputs
    assert long["prefill_need"] / long["decode_need"] > 4 * short["prefill_need"] / short["decode_need"]


def test_the_model_sizes_decode_batches_by_itl_and_kv() -> None:
    clock = StepClock.from_text("llama-3.1-70b@h100:fp8:tp4")
    roomy, tight = ReplicaModel(clock, 1.0, 0.03), ReplicaModel(clock, 1.0, 0.05, kv_tokens=64_000)
    cap = roomy.capacity(2000, 200)
    budget = 0.03 * DECODE_ITL_HEADROOM  # a margin below the target, for the batches above the mean
    assert cap.decode_batch < 256  # the ITL binds, not --max-num-seqs
    assert roomy.decode_step_seconds(cap.decode_batch, 2100) <= budget
    assert roomy.decode_step_seconds(cap.decode_batch + 1, 2100) > budget
    small = tight.capacity(2000, 200)
    assert small.decode_batch == math.floor(64_000 * 0.9 / 2100)  # the KV cache binds first
    assert cap.prefill_tokens_per_s < cap.prefill_peak_tokens_per_s  # TTFT headroom is kept
    assert not ReplicaModel(clock, 0.01, 0.05).capacity(8000, 100).ttft_feasible


def test_load_mode_signals() -> None:
    proposer = Proposer({"prefill": FixedModel(), "decode": FixedModel()}, disaggregated=True, mode="load")  # type: ignore[dict-item]
    replicas = {"prefill": {SERVING: 2}, "decode": {SERVING: 3}}
    hot = proposer.propose(Load(0, 0, 0), _obs(replicas=replicas, ttft_p90_s=1.5, decode_kv_usage=0.91))
    assert hot.replicas == {"prefill": 3, "decode": 4}
    assert any("decode KV 91% > 85%" in r for r in hot.reasons)
    quiet = proposer.propose(Load(0, 0, 0), _obs(replicas=replicas, ttft_p90_s=0.1, itl_p90_s=0.01,
                                                decode_kv_usage=0.1, queue_depth=0))
    assert quiet.replicas == {"prefill": 1, "decode": 2}


def test_hybrid_takes_the_signals_above_the_forecast() -> None:
    proposer = Proposer({"prefill": FixedModel(), "decode": FixedModel()}, disaggregated=True, mode="hybrid")  # type: ignore[dict-item]
    obs = _obs(replicas={"prefill": {SERVING: 3}, "decode": {SERVING: 3}}, decode_kv_usage=0.95, hit_fraction=0.25)
    assert proposer.propose(Load(300, 4000, 500), obs).replicas == {"prefill": 3, "decode": 4}


def test_corrections_are_bounded_and_need_warm_replicas() -> None:
    proposer = Proposer({"prefill": FixedModel(), "decode": FixedModel()}, disaggregated=True)  # type: ignore[dict-item]
    replicas = {"prefill": {SERVING: 3}, "decode": {SERVING: 3}}
    cold = _obs(requests=300, mean_isl=4000, mean_osl=500, ttft_p50_s=2.0, itl_p50_s=0.2, replicas=replicas)
    proposer.propose(Load(300, 4000, 500), cold)
    assert proposer.corrections.of("prefill") == 1.0  # no warm replica: no correction
    warm = _obs(requests=300, mean_isl=4000, mean_osl=500, ttft_p50_s=2.0, itl_p50_s=0.2, replicas=replicas,
                warm_replicas={"prefill": 3, "decode": 3})
    for _ in range(20):
        proposal = proposer.propose(Load(300, 4000, 500), warm)
    assert proposer.corrections.of("prefill") == pytest.approx(MAX_CORRECTION)  # 10x slower, bounded to 1.5x
    # no hit fraction observed: 10 x 4,000 / 10,000 = 4 prefill, 2.5 decode, each x1.5
    assert proposal.replicas == {"prefill": math.ceil(4.0 * MAX_CORRECTION), "decode": math.ceil(2.5 * MAX_CORRECTION)}


def test_an_aggregated_replica_whose_prefill_chunks_break_the_itl_target_says_so() -> None:
    clock = StepClock.from_text("llama-3.1-70b@h100:fp8:tp4")
    proposer = Proposer({"agg": ReplicaModel(clock, 1.0, 0.06, max_num_batched_tokens=8192)}, disaggregated=False)
    reasons = proposer.predictive(Load(60, 4000, 30), _obs()).reasons
    assert any("full prefill chunk" in r and "disaggregate" in r for r in reasons)  # ~240 ms steps
    small = Proposer({"agg": ReplicaModel(clock, 1.0, 0.06, max_num_batched_tokens=256)}, disaggregated=False)
    assert not any("full prefill chunk" in r for r in small.predictive(Load(60, 4000, 30), _obs()).reasons)


def test_spread_prompts_and_bursts_buy_prefill_headroom() -> None:
    """v = ½ is the M/D/1 utilisation 2x/(ln 100 + 2x); spread prompts (a larger v) lower the
    utilisation a prefill replica may run at; the busiest recent second sets a floor on the pool."""
    model = ReplicaModel(StepClock.from_text("llama-3.1-70b@h100:fp8:tp4"), 1.0, 0.05)
    equal = model.capacity(1200, 200, variability=0.5)
    x = (1.0 - equal.prefill_alone_s) / equal.prefill_alone_s
    assert equal.prefill_utilisation == pytest.approx(min(0.9, 2 * x / (math.log(100) + 2 * x)))
    spread = model.capacity(1200, 200, variability=5.0)
    assert spread.prefill_utilisation < equal.prefill_utilisation / 2
    assert spread.decode_tokens_per_s == equal.decode_tokens_per_s  # decode is not a queue for prompts

    def proposer() -> Proposer:
        return Proposer({"prefill": model, "decode": model}, disaggregated=True)

    load = Load(900, 1200, 200)
    calm = proposer().propose(load, _obs(requests=900, isl_cv2=0.0))
    spread_out = proposer().propose(load, _obs(requests=900, isl_cv2=3.0))
    assert spread_out.replicas["prefill"] > calm.replicas["prefill"]
    assert spread_out.replicas["decode"] == calm.replicas["decode"]
    # a burst of 400k prompt tokens in one second over a mean of 30 req/s x 1,200: its excess
    # cleared within 1 s + ½ s beside the mean load, at 90% of the full-chunk rate
    burst = proposer().propose(load, _obs(requests=900, isl_cv2=0.0, peak_prompt_tokens_per_s=400_000.0))
    mean = 30 * 1200
    expected = (mean + (400_000 - mean) / 1.5) / (model.full_chunk_tokens_per_s() * 0.9)
    assert burst.replicas["prefill"] == math.ceil(expected) > calm.replicas["prefill"]
    assert burst.replicas["decode"] == calm.replicas["decode"]
    assert any("busiest second" in r for r in burst.reasons)
    # a forecast of nothing (ISL 1) after the burst: the floor is still the burst's, in full chunks
    quiet = burst_proposer = proposer()
    burst_proposer.propose(load, _obs(requests=900, peak_prompt_tokens_per_s=400_000.0))
    alone = 400_000 / 1.5 / (model.full_chunk_tokens_per_s() * 0.9)
    assert quiet.propose(Load(0, 1, 1), _obs(requests=1, mean_isl=1.0)).replicas["prefill"] == math.ceil(alone)


def test_the_load_shape_holds_the_last_bursts_through_calm_intervals() -> None:
    shape = LoadShape(window=4)
    assert shape.variability() == 0.5 and shape.peak_tokens_per_s() == 0.0  # nothing measured yet
    shape.update(_obs(requests=3, isl_cv2=50.0))  # too few prompts to say anything
    assert shape.variability() == 0.5
    for cv2, peak in ((3.0, 90_000.0), (3.0, 5_000.0), (0.0, 4_000.0)):
        shape.update(_obs(requests=100, isl_cv2=cv2, peak_prompt_tokens_per_s=peak))
    assert shape.variability() == pytest.approx((1 + 2.0) / 2) and shape.peak_tokens_per_s() == 90_000.0
    for _ in range(4):
        shape.update(_obs(requests=100, isl_cv2=0.0, peak_prompt_tokens_per_s=4_000.0))
    assert shape.variability() == pytest.approx(0.5) and shape.peak_tokens_per_s() == 4_000.0  # left the window
    for _ in range(4):
        shape.update(_obs(requests=0))  # quiet intervals count as no burst, so zero traffic reaches the minimum
    assert shape.peak_tokens_per_s() == 0.0


def test_the_load_shape_keeps_the_median_stream_peaks_of_its_window() -> None:
    shape = LoadShape(window=3)
    assert shape.stream_peak_ratio() == 1.0  # nothing measured yet
    shape.update(_obs(streams_mean=4.0, streams_p90=40.0))  # too few streams to say anything
    shape.update(_obs(streams_mean=100.0, streams_p90=None))
    assert shape.stream_peak_ratio() == 1.0
    shape.update(_obs(streams_mean=100.0, streams_p90=140.0))
    shape.update(_obs(streams_mean=100.0, streams_p90=90.0))  # below the mean: counts as 1
    assert shape.stream_peak_ratio() == pytest.approx(1.2)
    shape.update(_obs(streams_mean=10.0, streams_p90=100.0))  # a ramp from nothing: bounded, and outvoted
    assert shape.stream_peak_ratio() == pytest.approx(1.4)
    shape.update(_obs(streams_mean=10.0, streams_p90=100.0))
    assert shape.stream_peak_ratio() == MAX_STREAM_PEAK_RATIO
    for _ in range(3):
        shape.update(_obs(streams_mean=200.0, streams_p90=220.0))
    assert shape.stream_peak_ratio() == pytest.approx(1.1)  # the old peaks left the window


def test_a_clairvoyant_forecast_sizes_for_the_coming_burst_not_the_past_one() -> None:
    model = ReplicaModel(StepClock.from_text("llama-3.1-70b@h100:fp8:tp4"), 1.0, 0.05)
    proposer = Proposer({"prefill": model, "decode": model}, disaggregated=True)
    past = _obs(requests=900, isl_cv2=0.0, peak_prompt_tokens_per_s=400_000.0)
    held = proposer.propose(Load(900, 1200, 200), past)
    calm_ahead = proposer.propose(Load(900, 1200, 200, peak_prompt_tokens_per_s=0.0), past)
    burst_ahead = proposer.propose(Load(900, 1200, 200, peak_prompt_tokens_per_s=800_000.0), past)
    def floor(peak: float) -> int:
        mean = 30 * 1200
        return math.ceil((mean + (peak - mean) / 1.5) / (model.full_chunk_tokens_per_s() * 0.9))

    assert held.replicas["prefill"] == floor(400_000)  # the past burst, held
    assert calm_ahead.replicas["prefill"] < held.replicas["prefill"]  # known calm: no floor
    assert burst_ahead.replicas["prefill"] == floor(800_000)
    assert any("the coming intervals brings 800,000" in r for r in burst_ahead.reasons)
