"""`tokenmill sim fleet` end to end: table, JSON, plot, and bad input (exit 2, one line, nothing written)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.datasets import MOONCAKE_TRACE, data_file

BASE = ["sim", "fleet", "--model", "llama-3.1-8b", "--gpu", "h100"]


def test_fleet_command_prints_a_table_and_writes_json_and_plot(tmp_path: Path, capsys) -> None:
    out, plot = tmp_path / "fleet.json", tmp_path / "fleet.png"
    code = main([*BASE, "--trace", str(data_file(MOONCAKE_TRACE)), "--max-requests", "200",
                 "--tokens-per-hash-block", "64", "--prefill", "1", "--decode", "2", "--ttft-ms", "500",
                 "--itl-ms", "30", "--json", str(out), "--plot", str(plot), "--change", "20:add:decode"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["totals"]["requests"] == 200 == len(report["requests"])
    assert report["changes"][0]["applied"] == 1
    assert 0.0 <= report["totals"]["sla_attainment"] <= 1.0 and report["totals"]["gpu_hours"] > 0
    assert plot.stat().st_size > 10_000
    assert "SLA attainment" in capsys.readouterr().out


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args, "--json", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, field", [
    (["--model", "no-such-model", "--gpu", "h100", "--agg", "1", "--synthetic", "poisson"], "model"),
    (["--model", "llama-3.1-8b", "--gpu", "tpu9", "--agg", "1", "--synthetic", "poisson"], "gpu"),
    (["--model", "llama-3.1-405b", "--gpu", "h100", "--agg", "1", "--layout", "tp1", "--precision", "bf16",
      "--synthetic", "poisson"], "--layout"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--agg", "1", "--layout", "tp3x", "--synthetic", "poisson"],
     "--layout"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--agg", "1", "--synthetic", "poisson", "--ttft-ms", "0"],
     "--ttft-ms"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--agg", "1", "--synthetic", "poisson", "--itl-ms", "-5"],
     "--itl-ms"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--agg", "1", "--synthetic", "poisson", "--change", "5:grow:agg"],
     "action"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--agg", "2", "--synthetic", "poisson", "--change", "60:add:prefill"],
     "--change"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--prefill", "1", "--synthetic", "poisson"], "--decode"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--agg", "1", "--synthetic", "poisson", "--change", "nan:add:agg"],
     "at_s"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--agg", "1", "--synthetic", "poisson", "--plot", "out.txt"],
     "--plot"),
])
def test_bad_input_exits_2_with_one_line_naming_the_field(args: list[str], field: str, tmp_path: Path) -> None:
    done = _run(["sim", "fleet", *args], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and field in lines[0], done.stderr
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_an_unwritable_output_is_refused_before_the_run(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "sim", "fleet", "--model", "llama-3.1-8b", "--gpu",
                           "h100", "--agg", "1", "--synthetic", "poisson", "--json", str(blocker / "out.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--json" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_malformed_trace_line_is_named(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    good = data_file(MOONCAKE_TRACE).read_text().splitlines()[:3]
    trace.write_text("\n".join([*good, '{"timestamp": 5, "input_length": "many", "output_length": 3, "hash_ids": []}']) + "\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    done = _run(["sim", "fleet", "--model", "llama-3.1-8b", "--gpu", "h100", "--agg", "1", "--trace", str(trace)], out_dir)
    assert done.returncode == 2
    assert "line 4" in done.stderr and "input_length" in done.stderr
    assert not list(out_dir.iterdir())
