"""The step clock against the step-time model it tabulates, and profile parsing."""
from __future__ import annotations

import random

import pytest

from tokenmill.sim.fleet.clock import StepClock, parse_layout, parse_profile
from tokenmill.step_work import StepWork


@pytest.mark.parametrize("profile", ["llama-3.1-8b@h100:fp8:tp1", "qwen3-30b-a3b@h100:bf16:tp2ep2",
                                     "deepseek-v3@gb200:fp4:tp4ep8dp8"])
def test_interpolated_steps_stay_within_a_few_percent_of_the_model(profile: str) -> None:
    clock = StepClock.from_text(profile)
    rng = random.Random(0)
    errors = []
    for _ in range(300):
        prefill = rng.choice([0, rng.randint(1, 8192)])
        seqs = rng.randint(0 if prefill else 1, 512)
        start = rng.randint(0, 8000)
        work = StepWork(prefill, StepWork.chunk_attended(start, prefill) if prefill else 0.0,
                        start + prefill if prefill else 0, seqs, seqs * rng.randint(1, 16_000),
                        seqs + (1 if prefill else 0))
        errors.append(abs(clock.seconds(work) / clock.direct(work) - 1))
    errors.sort()
    assert errors[len(errors) // 2] < 0.01
    assert errors[-1] < 0.05


def test_profiles_and_layouts_parse_and_bad_ones_name_the_flag() -> None:
    p = parse_profile("llama-3.1-70b@h100:tp4")
    assert (p.model, p.gpu, p.precision, p.tp, p.gpus) == ("llama-3.1-70b", "h100", "fp8", 4, 4)
    assert parse_profile("m@g:bf16:tp2ep2dp2").describe() == "m@g:bf16:tp2ep2dp2"
    assert parse_layout("tp8ep8dp8") == {"tp": 8, "pp": 1, "ep": 8, "dp": 8}
    for bad in ("llama", "@h100", "m@g:a:b:c"):
        with pytest.raises(ValueError, match="--mock-profile"):
            parse_profile(bad)
    with pytest.raises(ValueError, match="--layout"):
        parse_layout("tp0x", "--layout")
    with pytest.raises(ValueError, match="tp must divide"):
        StepClock.from_text("llama-3.1-8b@h100:fp8:tp3")


def test_kv_transfers_cross_nvlink_inside_a_domain_and_the_nic_outside_it() -> None:
    h100 = StepClock.from_text("llama-3.1-70b@h100:fp8:tp4")
    inside = h100.transfer_seconds(4096, receiver_gpus=4)  # 4 + 4 GPUs: one 8-GPU NVLink domain
    outside = h100.transfer_seconds(4096, receiver_gpus=8)
    g = h100.context.gpu
    latency = g.collective_latency_s
    assert (outside - latency) / (inside - latency) == pytest.approx(g.nvlink_bw / g.scaleout_bw)
    assert inside - latency == pytest.approx(h100.kv_bytes(4096) / (g.nvlink_bw * g.link_eff * 4))
    assert h100.kv_capacity_tokens() > 0
