"""Silicon (held-out subset) and published-figure validation."""
import numpy as np
import pytest

from tokenmill.sim.fit import summarise
from tokenmill.sim.paths import silicon_csv
from tokenmill.sim.published import deepseek_b200_max_throughput, deepseek_gb200_disagg, gb200_alltoall
from tokenmill.sim.silicon import load_silicon
from tokenmill.sim.tuning import load_fitted


@pytest.fixture(scope="module")
def silicon():
    return load_silicon(silicon_csv())


def test_silicon_coverage_and_split(silicon):
    assert silicon.total == 4254
    assert len(silicon.rows) + sum(silicon.excluded.values()) == silicon.total
    assert len(silicon.rows) > 2500
    held = sum(r.held_out for r in silicon.rows)
    assert 0.4 < held / len(silicon.rows) < 0.6


def test_held_out_subset_errors(silicon):
    # Every 3rd held-out row keeps the test fast. TPOT meets the 15% target (the full held-out
    # half is at ~14.2% in `sim validate`); TTFT is guarded at 36% (target 25%: not met, ~33.5%).
    held = [r for r in silicon.rows if r.held_out][::3]
    s = summarise(held, load_fitted())
    assert s.tpot_median_abs <= 0.15
    assert s.ttft_median_abs <= 0.36


def test_held_out_disaggregated_ttft(silicon):
    # Prefill pools batch the prompts waiting for them (was 91% when each forward took one prompt).
    held = [r for r in silicon.rows if r.held_out and r.mode == "disagg"]
    assert summarise(held, load_fitted()).ttft_median_abs <= 0.35


def test_fitted_tunings_exist_for_each_backend():
    fitted = load_fitted()
    assert {"trtllm", "vllm", "sglang", "default"} <= set(fitted)


@pytest.mark.parametrize("case", gb200_alltoall(), ids=lambda c: c.name)
def test_gb200_alltoall_within_30_percent(case):
    assert case.passed, f"{case.name}: {case.value:.1f} vs {case.target}"


def test_attention_dp_beats_attention_tp_at_max_throughput():
    _, direction, size = deepseek_b200_max_throughput()
    assert direction.passed and size.passed


def test_disaggregation_gain_on_gb200_and_its_trend():
    cases = deepseek_gb200_disagg()
    assert all(c.passed for c in cases), [(c.name, c.value) for c in cases]
    assert np.isfinite([c.value for c in cases]).all()
