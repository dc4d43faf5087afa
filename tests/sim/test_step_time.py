"""Step-time, memory and collective behaviour of the model."""
import numpy as np
import pytest

from tokenmill.sim.comms import allreduce_time, alltoall_time
from tokenmill.sim.deploy import estimate, make_context
from tokenmill.sim.hardware import get_gpu
from tokenmill.sim.memory import kv_bytes_per_token_per_gpu, weight_bytes_per_gpu
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.serving import Workload, aggregated

W = Workload(1024, 1024)


def test_tpot_grows_and_per_user_speed_falls_with_batch():
    c = make_context("llama-3.1-70b", "h100", "fp8")
    r = aggregated(c, Parallel.of(4), W, np.array([1.0, 8.0, 64.0, 256.0]))
    assert np.all(np.diff(r.tpot) > 0)
    assert np.all(np.diff(r.output_tps_per_gpu) > 0)


def test_tensor_parallelism_splits_weights_and_speeds_up_decode():
    c = make_context("llama-3.1-70b", "h100", "fp8")
    one, four = estimate(c, Parallel.of(2), W, 1), estimate(c, Parallel.of(8), W, 1)
    assert four.tpot_ms < one.tpot_ms
    assert four.memory_gb_per_gpu < one.memory_gb_per_gpu


def test_mla_latent_kv_is_replicated_across_tensor_parallel_ranks():
    c = make_context("deepseek-r1", "b200", "fp4")
    kv = kv_bytes_per_token_per_gpu(c.model, Parallel.of([1, 8]), c.plan)
    assert kv[0] == kv[1]
    gqa = make_context("llama-3.1-70b", "h100", "fp8")
    kv_gqa = kv_bytes_per_token_per_gpu(gqa.model, Parallel.of([1, 8]), gqa.plan)
    assert kv_gqa[0] == pytest.approx(8 * kv_gqa[1])


def test_memory_bounds_the_batch_and_flags_deployments_that_do_not_fit():
    c = make_context("llama-3.1-405b", "h100", "bf16")
    assert not estimate(c, Parallel.of(1), W, 1).fits  # 810 GB of weights on one 80 GB GPU
    c = make_context("llama-3.1-8b", "h100", "bf16")
    r = aggregated(c, Parallel.of(1), W, np.array([1e6]))
    assert not r.fits[0] and r.batch_capacity[0] > 100
    assert weight_bytes_per_gpu(c.model, Parallel.of(1), c.plan) / 1e9 == pytest.approx(16.06, rel=0.01)


def test_over_memory_concurrency_queues_in_ttft():
    c = make_context("llama-3.1-70b", "h100", "fp8")
    w = Workload(1024, 8192)
    cap = aggregated(c, Parallel.of(2), w, np.array([1.0])).batch_capacity[0]
    r = aggregated(c, Parallel.of(2), w, np.array([cap, 4 * cap]))
    assert r.ttft[1] > 3 * r.ttft[0]
    assert r.tpot[1] == pytest.approx(r.tpot[0])


def test_over_slot_concurrency_takes_turns_in_tpot():
    c = make_context("llama-3.1-70b", "h100", "fp8")
    r = aggregated(c, Parallel.of(2), Workload(1024, 1024), np.array([32.0, 32.0]), np.array([32.0, 8.0]))
    step8 = aggregated(c, Parallel.of(2), Workload(1024, 1024), np.array([8.0])).tpot[0]
    assert r.tpot[1] == pytest.approx(4 * step8)
    assert r.ttft[1] < 2 * r.ttft[0]
    assert not r.fits[1] and r.fits[0]


def test_collectives_cross_domain_is_slower():
    g = get_gpu("b200")
    nbytes = np.array([16e6])
    assert alltoall_time(g, np.array([16]), nbytes)[0] > 3 * alltoall_time(g, np.array([8]), nbytes)[0]
    assert allreduce_time(g, np.array([1]), nbytes)[0] == 0.0


def test_wide_ep_keeps_its_edge_only_inside_an_nvl72_domain():
    nvl72 = make_context("deepseek-r1", "gb200", "fp4")
    hgx = make_context("deepseek-r1", "gb200", "fp4")
    hgx = type(hgx)(hgx.model, hgx.gpu.with_overrides(domain_size=8), hgx.plan, hgx.tuning)
    par = Parallel.of(1, 1, 64, 64)
    fast = aggregated(nvl72, par, W, np.array([4096.0])).tpot[0]
    slow = aggregated(hgx, par, W, np.array([4096.0])).tpot[0]
    assert slow > 1.2 * fast


def test_impossible_layouts_raise():
    c = make_context("deepseek-r1", "b200", "fp4")
    with pytest.raises(ValueError, match="ep"):
        estimate(c, Parallel.of(1, 1, 3, 1), W, 1)
    with pytest.raises(ValueError, match="batch"):
        estimate(c, Parallel.of(8), W, 0)
