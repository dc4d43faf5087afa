"""`tokenmill bench tenants`' flags and its report's arithmetic (the runs themselves need a fleet)."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tokenmill.bench.harness.serve_stats import distribution_ms
from tokenmill.bench.serving.tenants_bench import ModeRun, _report, _tenants_file, add_arguments
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
    report = _report(parser.parse_args([]), runs)
    assert [r["p90_over_unloaded"] for r in report["runs"]] == pytest.approx([1.0, 25.0, 1.25, 2.0])
    assert report["target"] == {"p90_over_unloaded_with_classes": 1.5, "worst": pytest.approx(2.0), "met": False}
    assert report["schema"] == "tokenmill.bench.tenants" and report["config"]["flood"] == 5.0


def test_the_target_needs_every_interactive_request_answered() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    fast = distribution_ms([0.021] * 9)
    runs = [ModeRun("unloaded", 0, 10, 10, distribution_ms([0.02] * 10), 0, 0.0, 1.0),
            ModeRun("classes", 0, 9, 10, fast, 5, 100.0, 110.0)]  # quick, but one of ten failed
    assert _report(parser.parse_args([]), runs)["target"]["met"] is False
    runs[1] = ModeRun("classes", 0, 10, 10, fast, 5, 100.0, 110.0)
    assert _report(parser.parse_args([]), runs)["target"]["met"] is True
