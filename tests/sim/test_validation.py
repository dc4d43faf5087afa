"""Silicon (held-out subset) and published-figure validation, and `sim validate`'s exit status."""
import json
from dataclasses import replace

import numpy as np
import pytest

from tokenmill.cli import main
from tokenmill.sim import validate
from tokenmill.sim.fit import MIN_ROWS_PER_MODEL, ErrorSummary, fit_ttft_by_model, summarise
from tokenmill.sim.paths import silicon_csv
from tokenmill.sim.predict import predict_rows
from tokenmill.sim.published import (
    MIN_LATENCY_MTP3,
    Case,
    deepseek_b200_max_throughput,
    deepseek_b200_min_latency,
    deepseek_gb200_disagg,
    gb200_alltoall,
    min_latency_tps_per_user,
)
from tokenmill.sim.serving import Workload
from tokenmill.sim.silicon import load_silicon
from tokenmill.sim.tuning import TTFT_FIELDS, Tuning, load_fitted, pick_tuning


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
    # Every 3rd held-out row keeps the test fast; the targets are 15% (TPOT) and 25% (TTFT).
    # The whole held-out half is at ~14.7% / ~22.3% in `sim validate`; this third at ~13.9% / ~23.0%.
    held = [r for r in silicon.rows if r.held_out][::3]
    s = summarise(held, load_fitted())
    assert s.tpot_median_abs <= 0.15
    assert s.ttft_median_abs <= 0.25


def test_per_model_ttft_fields_change_only_aggregated_ttft(silicon):
    fitted = load_fitted()
    key = "trtllm/gpt-oss-120b"
    assert key in fitted, sorted(fitted)
    framework, specific = fitted["trtllm"], fitted[key]
    assert any(getattr(framework, f) != getattr(specific, f) for f in TTFT_FIELDS)
    assert replace(specific, **{f: getattr(framework, f) for f in TTFT_FIELDS}) == framework
    rows = [r for r in silicon.rows if r.backend == "trtllm" and r.model == "gpt-oss-120b" and r.mode == "agg"][:20]
    with_model = predict_rows(rows, fitted)
    without = predict_rows(rows, {"trtllm": framework})
    np.testing.assert_array_equal(with_model.tpot_ms, without.tpot_ms)
    assert not np.allclose(with_model.ttft_ms, without.ttft_ms)
    measured = np.array([r.ttft_ms for r in rows])
    # The pair's own fields fit its rows better than the framework's (gpt-oss's first token is ~40 ms).
    assert np.median(np.abs(np.log(with_model.ttft_ms / measured))) < np.median(np.abs(np.log(without.ttft_ms / measured)))


def test_pick_tuning_falls_back_from_model_to_framework_to_default():
    fitted = load_fitted()
    assert pick_tuning(fitted, "trtllm", "no-such-model") == fitted["trtllm"]
    assert pick_tuning(fitted, "no-such-framework", "gpt-oss-120b") == fitted["default"]
    assert pick_tuning({}, "trtllm", "gpt-oss-120b") == Tuning()
    # Without a framework, the default fit is TensorRT-LLM's, and so are the model's TTFT fields.
    assert pick_tuning(fitted, None, "gpt-oss-120b") == fitted["trtllm/gpt-oss-120b"]
    assert pick_tuning(fitted, None) == fitted["default"] == fitted["trtllm"]


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


def test_blog1_final_min_latency_figure_with_mtp3():
    (mtp3,) = deepseek_b200_min_latency()
    assert mtp3.passed, f"{mtp3.value:.0f} vs {mtp3.target:.0f}"
    assert mtp3.target == 368.0 and "blog 1" in mtp3.source and "3.10" in mtp3.source
    # Three draft layers cost time per step, so tokens/s/user grows by less than the acceptance rate.
    no_mtp = min_latency_tps_per_user(Workload(MIN_LATENCY_MTP3.isl, MIN_LATENCY_MTP3.osl))
    assert no_mtp < mtp3.value < 3.10 * no_mtp


def test_blog1_earlier_stage_no_mtp_figure_is_not_a_case():
    # "111 tok/s/user" is the no-MTP row of the blog's earlier (253-TPS MTP3) stage, not its final software.
    assert all(c.target != 111.0 and "no MTP" not in c.name for c in deepseek_b200_min_latency())


def test_qwen3_30b_a3b_active_reference_is_3_35_from_its_config():
    cases = {c.name: c for c in validate.accounting_cases() if c.name.startswith("qwen3-30b-a3b active")}
    assert len(cases) == 2, sorted(cases)
    for c in cases.values():
        assert c.target == 3.35 and "config.json" in c.source and "3.353" in c.source
        assert c.passed, f"{c.name}: {c.value} vs {c.target}"
    band = cases["qwen3-30b-a3b active params (B)"]
    assert band.tolerance == 0.01 and band.value == pytest.approx(3.353, abs=0.001)


def test_every_case_names_its_source():
    cases = validate.accounting_cases() + gb200_alltoall() + deepseek_b200_min_latency()
    assert all(c.source.strip() for c in cases)
    # Each accounting figure has its own source: the totals' and the active counts' differ where they come apart.
    targets = {t.model: t for t in validate.ACCOUNTING_TARGETS}
    assert targets["deepseek-r1"].total_src != targets["deepseek-r1"].active_src


def _result(cases: list[Case]) -> validate.ValidationResult:
    held = ErrorSummary(rows=10, tpot_median_abs=0.1, ttft_median_abs=0.2)
    return validate.ValidationResult(cases=cases, silicon_total=10, covered=10, train_rows=5, held_out=held,
                                     by_mode={"agg": held}, excluded={})


PASSING = Case("published", "passes", 1.0, 1.0, 0.1, "test source")
FAILING = Case("published", "fails", 2.0, 1.0, 0.1, "test source")


def test_exit_code_is_1_when_any_case_fails_and_0_when_all_pass():
    assert _result([PASSING, PASSING]).exit_code == 0
    failing = _result([PASSING, FAILING])
    assert failing.exit_code == 1
    assert failing.failed == [FAILING]
    assert failing.to_json()["passed"] is False and failing.to_json()["failed"] == ["fails"]


def test_a_failing_accounting_target_fails_the_run(monkeypatch):
    wrong = replace(validate.ACCOUNTING_TARGETS[3], active_b=3.3)  # the old, truncated Qwen3-30B-A3B figure
    assert wrong.model == "qwen3-30b-a3b"
    monkeypatch.setattr(validate, "ACCOUNTING_TARGETS", (wrong,))
    result = _result(validate.accounting_cases())
    assert [c.name for c in result.failed] == ["qwen3-30b-a3b active params (B)",
                                               "qwen3-30b-a3b active params rounds to reference"]
    assert result.exit_code == 1


@pytest.mark.parametrize("cases, code", [([PASSING], 0), ([PASSING, FAILING], 1)])
def test_sim_validate_command_exit_status(monkeypatch, tmp_path, capsys, cases, code):
    monkeypatch.setattr(validate, "run_validation", lambda *a, **k: _result(cases))
    out = tmp_path / "v.json"
    assert main(["sim", "validate", "--json", str(out)]) == code
    body = json.loads(out.read_text())
    assert body["passed"] is (code == 0)
    assert all(c["source"] == "test source" for c in body["cases"])
    printed = capsys.readouterr().out
    assert "[1] test source" in printed and ("FAIL: fails" in printed) is (code == 1)


def test_sim_validate_passes_every_case_and_exits_0(tmp_path):
    out = tmp_path / "v.json"
    assert main(["sim", "validate", "--json", str(out)]) == 0
    body = json.loads(out.read_text())
    assert body["passed"] is True and body["failed"] == []
    assert all(c["passed"] and c["source"] for c in body["cases"])


def test_attention_dp_beats_attention_tp_at_max_throughput():
    _, direction, size = deepseek_b200_max_throughput()
    assert direction.passed and size.passed


def test_disaggregation_gain_on_gb200_and_its_trend():
    cases = deepseek_gb200_disagg()
    assert all(c.passed for c in cases), [(c.name, c.value) for c in cases]
    assert np.isfinite([c.value for c in cases]).all()


def test_fit_ttft_by_model_uses_aggregated_training_rows_only(silicon):
    stored = load_fitted()
    framework = {"trtllm": stored["trtllm"]}
    train = [r for r in silicon.rows if not r.held_out and r.backend == "trtllm" and r.model == "gpt-oss-120b"]
    fitted = fit_ttft_by_model(train, framework, rounds=1)
    assert set(fitted) == {"trtllm/gpt-oss-120b"}
    tuning = fitted["trtllm/gpt-oss-120b"]
    assert replace(tuning, **{f: getattr(stored["trtllm"], f) for f in TTFT_FIELDS}) == stored["trtllm"]
    assert fit_ttft_by_model([r for r in train if r.mode == "disagg"], framework) == {}
    assert fit_ttft_by_model(train[:MIN_ROWS_PER_MODEL - 1], framework) == {}
