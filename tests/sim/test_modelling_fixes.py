"""Physics added for the validation cases: memory in GiB, hierarchical all-reduce, 4-bit MoE attention,
attention-DP waiting on its busiest rank."""
import numpy as np
import pytest

from tokenmill.sim.comms import allreduce_time
from tokenmill.sim.deploy import make_context
from tokenmill.sim.hardware import get_gpu
from tokenmill.sim.memory import weight_bytes_per_gpu
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.precision import PrecisionPlan
from tokenmill.sim.search import search_aggregated
from tokenmill.sim.serving import Workload, aggregated, busiest_rank_arrivals


def test_hbm_capacity_is_what_nvidia_smi_reports():
    # 183,359 MiB on a B200: the datasheet's "180 GB" is GiB-sized.
    assert get_gpu("b200").hbm_gb == pytest.approx(183_359 * 2**20 / 1e9, rel=1e-3)
    assert get_gpu("h100").hbm_gb > 80


def test_allreduce_across_domains_uses_every_nic_of_the_domain():
    g = get_gpu("b200")
    nbytes = np.array([64e6])
    inside, across = allreduce_time(g, np.array([8, 16]), nbytes)
    # A flat ring over the NIC would move 2*15/16 of 64 MB through one 50 GB/s NIC: > 2 ms.
    flat = 2 * 15 / 16 * nbytes[0] / (g.scaleout_bw * g.link_eff)
    assert inside < across < flat / 4
    # Inside one domain it is the plain NVLink ring.
    ring = g.collective_latency_s + 2 * 7 / 8 * nbytes[0] / (g.nvlink_bw * g.link_eff)
    assert inside == pytest.approx(ring)


def test_four_bit_moe_checkpoints_keep_attention_out_of_fp4():
    moe = PrecisionPlan.named("fp4", moe=True)
    assert moe.weights.name == "nvfp4" and moe.attention_weights.name == "fp8"
    assert PrecisionPlan.named("fp4", kv="bf16", moe=True).attention_weights.name == "bf16"
    assert PrecisionPlan.named("fp4").attention_weights.name == "nvfp4"  # dense NVFP4 quantizes attention too
    assert PrecisionPlan.named("fp8", moe=True).attention_weights.name == "fp8"
    c = make_context("deepseek-r1", "b200", "fp4")
    all_fp4 = type(c.plan)(c.plan.weights, c.plan.activations, c.plan.kv)
    par = Parallel.of(8)
    assert float(weight_bytes_per_gpu(c.model, par, c.plan)) > float(weight_bytes_per_gpu(c.model, par, all_fp4))


def test_busiest_rank_arrivals_match_the_poisson_maximum():
    rng = np.random.default_rng(7)
    for rate, ranks in ((0.2, 8), (3.0, 16)):
        sampled = rng.poisson(rate, (100_000, ranks)).max(axis=1).mean()
        assert busiest_rank_arrivals(np.array([rate]), np.array([ranks]))[0] == pytest.approx(sampled, rel=0.02)
    assert busiest_rank_arrivals(np.array([0.2]), np.array([1]))[0] == pytest.approx(0.2)


def test_attention_dp_steps_wait_for_the_busiest_rank_unless_balanced():
    c = make_context("deepseek-r1", "b200", "fp4")
    par, w, batch = Parallel.of(1, 1, 8, 8), Workload(1024, 2048), np.array([2048.0])
    plain = aggregated(c, par, w, batch)
    balanced = aggregated(c.with_tuning(adp_balance=True), par, w, batch)
    assert plain.tpot[0] > 1.1 * balanced.tpot[0]  # a 1K prompt on one rank stalls the other seven
    assert balanced.ttft[0] > plain.ttft[0]  # balance holds context requests back
    tp = Parallel.of(8, 1, 8, 1)  # one attention rank: nothing to balance
    assert aggregated(c, tp, w, np.array([256.0])).tpot[0] == pytest.approx(
        aggregated(c.with_tuning(adp_balance=True), tp, w, np.array([256.0])).tpot[0])


def test_search_offers_adp_balance_as_a_design_choice():
    c = make_context("deepseek-r1", "b200", "fp4")
    points = search_aggregated(c, Workload(1024, 1024), 8)
    balanced = points.detail["adp_balance"] == 1.0
    assert balanced.any() and (~balanced).any()
    assert np.all(points.detail["dp"][balanced] > 1)


def test_a_lone_request_decodes_without_prefill_in_its_steps():
    # Its own prompt is its TTFT; only other requests' prompts interleave with its decode steps.
    from tokenmill.sim.serving import decode_step
    c = make_context("deepseek-r1", "gb200", "fp4")
    par, w = Parallel.of(8), Workload(8192, 256)
    r = aggregated(c, par, w, np.array([1.0, 2.0]))
    assert r.tpot[0] == pytest.approx(decode_step(c, par, w, np.array([1.0]))[0])
    assert r.tpot[1] > decode_step(c, par, w, np.array([2.0]))[0]  # the other request's 8K prompt interleaves
