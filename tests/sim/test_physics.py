"""Physical terms of the step-time model: per-sequence host overhead, engine decode slots, wide EP."""
import numpy as np
import pytest

from tokenmill.sim.deploy import make_context
from tokenmill.sim.disagg import decode_pool
from tokenmill.sim.layouts import batch_grid, cross
from tokenmill.sim.operators import OpContext, StepShape
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.serving import Workload, aggregated
from tokenmill.sim.step_time import framework_overhead
from tokenmill.sim.tuning import Tuning


def test_framework_overhead_grows_per_running_sequence():
    c = make_context("llama-3.1-8b", "h100", "fp8")
    c = OpContext(c.model, c.gpu, c.plan, Tuning(step_overhead_s=1e-3, seq_overhead_s=20e-6))
    seqs = np.array([1.0, 101.0])
    shape = StepShape(np.zeros(1), np.ones(1), seqs, np.ones(1))
    over = framework_overhead(c, shape)
    assert over[1] - over[0] == pytest.approx(100 * 20e-6)
    with pytest.raises(ValueError, match="seq_overhead_s"):
        Tuning(seq_overhead_s=-1.0)


def test_engine_decode_slots_bound_max_throughput():
    c = make_context("deepseek-r1", "b200", "fp4", backend="trtllm")
    par = Parallel.of(1, 1, 8, 8)
    w = Workload(1024, 2048)
    wide = OpContext(c.model, c.gpu, c.plan, c.tuning.replace(max_batch_per_rank=4096))
    batches = batch_grid(16384)
    capped = aggregated(c, Parallel.of(*(np.repeat(v, batches.size) for v in (1, 1, 8, 8))), w, batches)
    free = aggregated(wide, Parallel.of(*(np.repeat(v, batches.size) for v in (1, 1, 8, 8))), w, batches)
    assert capped.fits[batches == 8 * c.tuning.max_batch_per_rank].all()
    assert not capped.fits[batches > 8 * c.tuning.max_batch_per_rank].any()
    best = lambda r: np.max(np.where(r.fits, r.output_tps_per_gpu, 0.0))  # noqa: E731
    assert best(capped) < best(free)
    assert aggregated(c, par, w, np.array([8.0 * 384])).batch_capacity[0] == 8 * 384


def _best_decode(c: OpContext, ep: int, itl_s: float) -> float:
    par, batch = cross(Parallel.of(1, 1, ep, ep), batch_grid(65536))
    pool = decode_pool(c, par, Workload(1024, 1024), batch)
    ok = pool.fits & (pool.tpot <= itl_s)
    return float(np.max(np.where(ok, batch / pool.tpot / par.gpus, 0.0)))


def test_wide_ep_wins_inside_nvl72_and_loses_across_8_gpu_domains():
    c = make_context("deepseek-r1", "gb200", "fp4", backend="trtllm")
    nvl = [_best_decode(c, ep, 0.03) for ep in (8, 16, 32, 64)]
    assert nvl == sorted(nvl) and nvl[-1] > 1.2 * nvl[0]
    split = OpContext(c.model, c.gpu.with_overrides(domain_size=8), c.plan, c.tuning)
    assert _best_decode(split, 64, 0.03) < nvl[0]
