"""`sim calibrate --model`: the step-time model fitted to tokenmill's own engine steps."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from tokenmill.sim.deploy import make_context
from tokenmill.sim.engine_fit import (
    StepSample,
    _predict,
    engine_layout,
    fit_engine,
    measure_engine_steps,
    predict_engine_decode_step,
)
from tokenmill.sim.hardware import get_gpu, load_gpu_file
from tokenmill.sim.local_calibrate import calibrate_local
from tokenmill.sim.models import get_model
from tokenmill.sim.tuning import Tuning
from tokenmill.step_work import StepWork


def _shapes() -> list[StepWork]:
    prefill = [StepWork(n, StepWork.chunk_attended(0, n), n, 0, 0, 1) for n in (16, 64, 256, 512)]
    decode = [StepWork(0, 0.0, 0, b, b * c, b) for c in (128, 512) for b in (1, 2, 4, 8, 16)]
    return prefill + decode


def test_the_fit_recovers_step_times_made_by_known_parameters(tiny_moe: Path) -> None:
    base = get_gpu("h100")
    truth_gpu = dataclasses.replace(base, kernel_latency_s=4e-5, mem_eff=0.03, gemm_eff_max=0.2)
    truth_tuning = Tuning(step_overhead_s=3e-3, seq_overhead_s=2e-4)
    model = get_model(str(tiny_moe))
    works = _shapes()
    times = _predict(model, truth_gpu, truth_tuning, "bf16", [StepSample(w, 1.0) for w in works])
    fit = fit_engine(tiny_moe, base, [StepSample(w, t) for w, t in zip(works, times)])
    assert fit.median_error < 0.05
    fitted = _predict(model, dataclasses.replace(base, **fit.gpu_fields), Tuning(**fit.tuning_fields), "bf16",
                      [StepSample(w, 1.0) for w in works])
    assert np.max(np.abs(fitted / times - 1)) < 0.15


def test_engine_steps_are_measured_for_every_shape(tiny_dense: Path) -> None:
    samples = measure_engine_steps(tiny_dense, threads=1, repeats=1)
    assert [s.work for s in samples] == [
        *[StepWork(n, StepWork.chunk_attended(0, n), n, 0, 0, 1) for n in (16, 64, 256, 512)],
        *[StepWork(0, 0.0, 0, b, b * (c + 1), b) for c in (128, 512) for b in (1, 2, 4, 8, 16)]]
    assert all(s.seconds > 0 for s in samples)


def test_a_fitted_cpu_local_entry_drives_the_simulator(tiny_dense: Path, tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "cpu-local.json"
    monkeypatch.setenv("TOKENMILL_CPU_LOCAL", str(path))
    calibrate_local(path, quick=True, model=str(tiny_dense))
    entry = json.loads(path.read_text())
    assert set(entry["tuning"]) == {"step_overhead_s", "seq_overhead_s"}
    assert "fitted to tokenmill's engine steps" in entry["sources"]["mem_eff"]
    assert load_gpu_file(path).mem_eff == pytest.approx(entry["mem_eff"])
    context = make_context(str(tiny_dense), "cpu-local", "bf16")
    assert context.tuning.step_overhead_s == pytest.approx(entry["tuning"]["step_overhead_s"])
    assert make_context(str(tiny_dense), "cpu-local", "bf16", backend="trtllm").tuning != context.tuning
    if (os.cpu_count() or 1) >= 2:  # the link between rank processes, measured with the engine's collectives
        assert "the engine's collectives" in entry["sources"]["collective_latency_s"]
        assert 0 < entry["collective_latency_s"] < 1 and entry["nvlink_bw"] > 1e6 and entry["a2a_latency_s"] > 0
        assert entry["domain_size"] == os.cpu_count()
    else:
        assert "collective_latency_s" not in entry["sources"]
    one = predict_engine_decode_step(tiny_dense, 1, 1, 1, batch=8, context=200)
    two = predict_engine_decode_step(tiny_dense, 2, 1, 1, batch=8, context=200)
    assert one.communication_s == 0 and 0 < one.step_s
    assert two.layout == "tp2 ep1 dp1" and two.communication_s > 0


def test_engine_layouts_map_to_the_simulators(tiny_moe: Path, tmp_path: Path, monkeypatch) -> None:
    assert [(int(p.tp), int(p.ep), int(p.dp)) for p in (engine_layout(2, 1, 1), engine_layout(2, 2, 1),
                                                        engine_layout(1, 2, 2))] == [(2, 1, 1), (2, 2, 1), (1, 2, 2)]
    assert engine_layout(1, 2, 1) is None  # replicated attention: not a layout the simulator has
    assert predict_engine_decode_step(tiny_moe, 1, 2, 1, 8, 100).step_s is None
    monkeypatch.setenv("TOKENMILL_CPU_LOCAL", str(tmp_path / "absent.json"))
    missing = predict_engine_decode_step(tiny_moe, 2, 1, 1, 8, 100)
    assert missing.step_s is None and "sim calibrate" in missing.reason
