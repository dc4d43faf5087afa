"""`tokenmill bench tenants`' flags and its report's arithmetic (the runs themselves need a fleet)."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tokenmill.bench.harness.serve_stats import distribution_ms
from tokenmill.bench.serving.tenants_bench import (
    BATCH_SHARE,
    MODES,
    ModeRun,
    _classes,
    _interactive_specs,
    _report,
    _tenants_file,
    add_arguments,
)
from tokenmill.bench.serving.tenants_sim import simulate_mode
from tokenmill.cli import main
from tokenmill.tenants.config import load_tenants


@pytest.mark.parametrize(("flags", "named"), [
    (["--workers", "0"], "--workers"), (["--flood", "-1"], "--flood"), (["--duration-s", "0"], "--duration-s"),
    (["--model", "/nowhere"], "--model /nowhere"),
])
def test_bad_flags_exit_2_naming_the_flag(flags: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tenants", *flags]) == 2
    assert named in capsys.readouterr().out


def test_each_mode_writes_the_tenants_file_it_names(tmp_path: Path) -> None:
    classes = load_tenants(_tenants_file("classes", tmp_path / "a.toml"))
    assert {t.name: t.priority_class for t in classes.tenants} == {"assistant": "interactive", "sweeps": "batch"}
    one = load_tenants(_tenants_file("one-class", tmp_path / "b.toml"))
    assert {t.priority_class for t in one.tenants} == {"standard"}


def test_the_report_divides_each_p90_by_the_unloaded_one_and_checks_the_worst_with_classes() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    def run(mode: str, ttft_s: list[float]) -> ModeRun:
        return ModeRun(mode, 0, len(ttft_s), len(ttft_s), distribution_ms(ttft_s), 5, 100.0, 110.0)
    runs = [run("unloaded", [0.02] * 10), run("one-class", [0.5] * 10), run("classes", [0.025] * 10),
            run("classes", [0.04] * 10)]
    report = _report(parser.parse_args([]), runs, [])
    assert [r["p90_over_unloaded"] for r in report["runs"]] == pytest.approx([1.0, 25.0, 1.25, 2.0])
    assert report["target"] == {"p90_over_unloaded_with_classes": 1.5, "worst": pytest.approx(2.0), "met": False}
    assert report["schema"] == "tokenmill.bench.tenants" and report["config"]["flood"] == 5.0


def test_each_repeat_is_divided_by_its_own_unloaded_run() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    def run(mode: str, repeat: int, ttft_s: float) -> ModeRun:
        return ModeRun(mode, repeat, 10, 10, distribution_ms([ttft_s] * 10), 5, 100.0, 110.0)
    runs = [run("unloaded", 0, 0.02), run("classes", 0, 0.03), run("classes", 1, 0.03), run("unloaded", 1, 0.03)]
    report = _report(parser.parse_args([]), runs, [])
    assert [r["p90_over_unloaded"] for r in report["runs"]] == pytest.approx([1.0, 1.5, 1.0, 1.0])
    assert report["target"]["worst"] == pytest.approx(1.5) and report["target"]["met"] is True


def test_the_target_needs_every_interactive_request_answered() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    fast = distribution_ms([0.021] * 9)
    runs = [ModeRun("unloaded", 0, 10, 10, distribution_ms([0.02] * 10), 0, 0.0, 1.0),
            ModeRun("classes", 0, 9, 10, fast, 5, 100.0, 110.0)]  # quick, but one of ten failed
    assert _report(parser.parse_args([]), runs, [])["target"]["met"] is False
    runs[1] = ModeRun("classes", 0, 10, 10, fast, 5, 100.0, 110.0)
    assert _report(parser.parse_args([]), runs, [])["target"]["met"] is True


def test_the_simulated_column_runs_the_live_arrivals_and_shows_what_the_classes_do() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--duration-s", "10"])
    arrivals = [spec.arrival_s for spec in _interactive_specs(args, 1000, 0)]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 10
    slots = 20
    rows = {mode: simulate_mode(args, mode, arrivals, slots, BATCH_SHARE, _classes(mode)) for mode in MODES}
    assert all(r["interactive_ok"] == r["interactive_sent"] == len(arrivals) for r in rows.values())
    p90 = {mode: r["interactive_ttft"].p90 for mode, r in rows.items()}
    # one class: each interactive request waits for a batch request to free one of the slots
    assert p90["one-class"] > 10 * p90["unloaded"] and p90["classes"] < 2 * p90["unloaded"]
    assert rows["unloaded"]["batch_output_tok_s"] == 0 and rows["classes"]["batch_output_tok_s"] > 0
    assert rows["classes"]["fleet_output_tok_s"] > rows["classes"]["batch_output_tok_s"]
    # the flood keeps every replica stepping; alone, the interactive tenant leaves them mostly idle
    assert 0.9 <= rows["classes"]["fleet_utilisation"] <= 1.0 and rows["unloaded"]["fleet_utilisation"] < 0.5
    report = _report(args, [ModeRun("unloaded", 0, 1, 1, distribution_ms([0.05]), 0, 0.0, 1.0)], list(rows.values()))
    assert [r["mode"] for r in report["simulated"]] == list(MODES)
    assert report["simulated"][0]["p90_over_unloaded"] == 1.0 and report["simulated"][1]["p90_over_unloaded"] > 10
