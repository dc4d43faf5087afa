"""`--mock-profile MODEL@GPU[:precision][:layout]`: mock workers clocked by the simulator.

A served profile answers, with the profile's KV capacity as the pool; a bad one is refused in
one line naming the flag, by `serve` before any worker starts and by `worker` itself.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import start_server, stop_server
from tokenmill.engine.cli_args import add_engine_arguments, engine_argv, engine_config_from_args
from tokenmill.sim.fleet.clock import StepClock

PROFILE = "llama-3.1-8b@h100:fp8:tp1"
BAD_PROFILES = [
    "llama-3.1-8b",  # no GPU
    "no-such-model@h100",
    "llama-3.1-8b@no-such-gpu",
    "llama-3.1-8b@h100:fp8:tp3",  # tp must divide the 32 attention heads
    "llama-3.1-8b@h100:fp8:tp1:extra",
    "llama-3.1-405b@h100:bf16:tp1",  # the weights alone exceed one H100
]


def tokenmill(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *argv], capture_output=True, text=True,
                          timeout=120)


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (a test's own run directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass  # gone meanwhile
    return pids


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_mock_flags_pass_through_to_workers() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", "m", "--runner", "mock", "--mock-profile", PROFILE, "--mock-speedup", "20"])
    again = parser.parse_args(engine_argv(args))
    assert (again.mock_profile, again.mock_speedup) == (PROFILE, 20.0)
    assert engine_config_from_args(again).mock_speedup == 20.0
    assert engine_config_from_args(parser.parse_args(["--model", "m"])).mock_speedup == 1.0


def test_serve_with_a_profile_answers_and_sizes_the_pool_from_it(tiny_dense: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dense, tmp_path, "--runner", "mock", "--mock-profile", PROFILE,
                          "--mock-speedup", "20")
    try:
        reply = httpx.post(server.url + "/v1/completions", timeout=60, trust_env=False, json={
            "model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 12
        (worker,) = server.registry()
        assert worker["metadata"]["num_blocks"] == StepClock.from_text(PROFILE).kv_capacity_tokens() // 16
        # no --usd-per-worker-hour: the profile's one H100 at $3 per GPU-hour, 20 GPU-hours per wall hour
        text = httpx.get(server.url + "/metrics", trust_env=False).text
        gauges = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith(("tokenmill_usd_per_worker_hour ", "tokenmill_cost_per_million_tokens "))}
        assert gauges["tokenmill_usd_per_worker_hour"] == 1 * 3.0 * 20
        assert gauges["tokenmill_cost_per_million_tokens"] > 0
    finally:
        stop_server(server)


@pytest.mark.parametrize("profile", BAD_PROFILES)
def test_serve_refuses_a_bad_profile_before_any_worker_starts(tiny_dense: Path, tmp_path: Path,
                                                              profile: str) -> None:
    run_dir = tmp_path / "run"
    result = tokenmill("serve", "--model", str(tiny_dense), "--runner", "mock", "--mock-profile", profile,
                       "--run-dir", str(run_dir), "--port", "0")
    lines = error_lines(result)
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "--mock-profile" in lines[0], result.stderr
    assert not run_dir.exists()  # no registry, no sockets: no worker was started
    assert not processes_mentioning(str(run_dir))


@pytest.mark.parametrize("profile", BAD_PROFILES[1:3] + BAD_PROFILES[-1:])
def test_worker_refuses_a_bad_profile(tiny_dense: Path, tmp_path: Path, profile: str) -> None:
    registry = tmp_path / "registry"
    result = tokenmill("worker", "--model", str(tiny_dense), "--runner", "mock", "--mock-profile", profile,
                       "--discovery", f"file:{registry}", "--address", f"ipc://{tmp_path}/w.sock")
    lines = error_lines(result)
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "--mock-profile" in lines[0], result.stderr
    assert not registry.exists() or not list(registry.glob("*.json"))
    assert not processes_mentioning(str(tmp_path))


@pytest.mark.parametrize("command", ["serve", "worker"])
@pytest.mark.parametrize("flags,names", [
    (("--runner", "mock", "--mock-profile", PROFILE, "--mock-step-time", "0.01,0,0,0"),
     ("--mock-profile", "--mock-step-time")),
    (("--mock-profile", PROFILE), ("--mock-profile", "--runner mock")),
    (("--runner", "mock", "--mock-speedup", "0"), ("--mock-speedup",)),
])
def test_conflicting_mock_flags_are_refused(tiny_dense: Path, tmp_path: Path, command: str,
                                            flags: tuple[str, ...], names: tuple[str, ...]) -> None:
    extra = ("--discovery", f"file:{tmp_path}/registry") if command == "worker" else ("--port", "0")
    result = tokenmill(command, "--model", str(tiny_dense), *flags, *extra)
    lines = error_lines(result)
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and all(name in lines[0] for name in names), result.stderr
