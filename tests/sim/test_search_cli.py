"""Search, Pareto frontier and the `tokenmill sim` CLI contract."""
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.cli import main
from tokenmill.sim import get_gpu, get_model, step_coefficients
from tokenmill.sim.deploy import make_context
from tokenmill.sim.pareto import pareto_mask, usd_per_million_tokens
from tokenmill.sim.search import run_search
from tokenmill.sim.serving import Workload

ESTIMATE_KEYS = {"ttft_ms", "tpot_ms", "output_tokens_per_s_per_gpu", "tokens_per_s_per_user", "memory_gb_per_gpu", "fits"}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.integers(1, 50)), min_size=1, max_size=40))
def test_pareto_mask_matches_brute_force(points):
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    mask = pareto_mask(x, y)
    dominated = [bool(np.any((x >= x[i]) & (y >= y[i]) & ((x > x[i]) | (y > y[i])))) for i in range(len(x))]
    assert not any(mask[i] and dominated[i] for i in range(len(x)))  # kept points are undominated
    undominated = {(x[i], y[i]) for i in range(len(x)) if not dominated[i]}
    kept = [(x[i], y[i]) for i in range(len(x)) if mask[i]]
    assert sorted(kept) == sorted(undominated)  # each undominated point kept exactly once


def test_cost_per_million_tokens():
    assert usd_per_million_tokens(1000.0, 3.6) == 1.0


def test_search_covers_both_modes_and_disagg_wins_for_long_inputs():
    c = make_context("deepseek-r1", "gb200", "fp4", backend="trtllm")
    res = run_search(c, Workload(8192, 256), 72)
    assert res.points_evaluated > 100_000
    best = {m: np.max(np.where(p.feasible, p.tps_gpu, 0)) for m, p in (("agg", res.agg), ("disagg", res.disagg))}
    assert best["disagg"] > best["agg"]


def test_estimate_json_contract(capsys):
    rc = main(["sim", "estimate", "--model", "llama-3.1-8b", "--gpu", "h100", "--tp", "1", "--batch", "8",
               "--isl", "512", "--osl", "128", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and set(out) == ESTIMATE_KEYS and out["fits"] is True
    assert out["tokens_per_s_per_user"] == pytest.approx(1000.0 / out["tpot_ms"], rel=1e-12)


def test_search_cli_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    rc = main(["sim", "search", "--model", "qwen3-30b-a3b", "--gpu", "h200", "--gpus", "8", "--isl", "1024",
               "--osl", "256", "--ttft-ms", "2000", "--itl-ms", "50", "--json", str(out), "--plot", str(png)])
    data = json.loads(out.read_text())
    assert rc == 0 and png.stat().st_size > 10_000
    assert {"points_evaluated", "seconds", "frontier", "best"} <= set(data)
    for mode in ("agg", "disagg"):
        tps_user = [p["tokens_per_s_per_user"] for p in data["frontier"][mode]]
        tps_gpu = [p["output_tokens_per_s_per_gpu"] for p in data["frontier"][mode]]
        assert tps_user == sorted(tps_user) and tps_gpu == sorted(tps_gpu, reverse=True)
    best = data["best"][data["best"]["overall"]]
    assert best["tpot_ms"] <= 50 and best["ttft_ms"] <= 2000 and best["usd_per_million_tokens"] > 0


def test_bad_input_returns_error_code():
    assert main(["sim", "estimate", "--model", "nope", "--gpu", "h100", "--batch", "1", "--isl", "1", "--osl", "1"]) == 2


def test_calibrate_writes_a_loadable_cpu_local_entry(tmp_path):
    path = tmp_path / "cpu.json"
    assert main(["sim", "calibrate", "--quick", "--out", str(path)]) == 0
    gpu = get_gpu("cpu-local", cpu_local_file=path)
    assert gpu.fp32_flops > 1e8 and gpu.hbm_bw > 1e8
    assert gpu.domain_size == (os.cpu_count() or 1)  # the ranks of a parallel worker share this host


def test_step_coefficients_are_positive_and_track_the_model():
    m, g = get_model("llama-3.1-8b"), get_gpu("h100")
    k = step_coefficients(m, g)
    assert min(k.a, k.b, k.d) > 0
    # weight streaming dominates a tiny step: 16 GB of BF16 weights at a few TB/s is a few ms
    assert 2e-3 < k.a < 20e-3
    # per prefill token: about 2 x 8e9 FLOPs at a fraction of 989 TFLOP/s
    assert 1e-5 < k.b * 1e3 < 1e-1
    assert k.step_seconds(512, 8, 8 * 1024) > k.step_seconds(0, 1, 1024)
