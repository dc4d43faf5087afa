"""`tokenmill bench frontend`: the serving hot path, with workers that cost nothing.

One `tokenmill serve --runner mock --mock-step-time 0,0,0,0 --workers N` is measured, in order:
1. start-up: seconds from Popen to the first 200 of a real POST /v1/completions (polled every 10 ms);
2. idle RSS: once every worker is connected and the server has idled 2 s, VmRSS summed over serve,
   its descendants and the registered workers;
3. two wrk load runs against /v1/completions, each after a wrk warm-up: non-streaming with
   `max_tokens: 1`, and streaming `--stream-tokens` tokens with `ignore_eos`. Around each measured
   run the CPU seconds (utime + stime) of every serving process are read, so CPU per 1,000
   requests and its frontend / workers split exclude wrk itself.

req/s counts successful responses (wrk's status errors, i.e. status > 399, left out) over wrk's
measured duration; latencies are wrk's, to the whole response (the last SSE chunk when streaming).
The targets are the project's; they are reported (met / miss), never asserted.

JSON (`--json OUT`, schema "tokenmill.bench.frontend", version 1): {schema, schema_version,
config {every flag, model (the one served), serve_argv, wrk_argv (the measured runs'), cpu_count},
startup {first_200_s, all_workers_s}, idle_rss {total_mib, processes [{pid, role, mib}]},
runs {non_streaming, streaming: LoadResult's fields}, targets {name: {op, target, value, met}}}
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.harness import frontend_procs as procs
from tokenmill.bench.harness.serve_process import HOST, ServeProcess, free_port, stop
from tokenmill.bench.serving.frontend_report import TARGETS, LoadResult, render, target_checks
from tokenmill.bench.serving.frontend_wrk import lua_script, run_wrk, wrk_argv

log = logging.getLogger(__name__)

SCHEMA_NAME, SCHEMA_VERSION = "tokenmill.bench.frontend", 1
SERVED_NAME = "frontend-bench"
PROMPT = "The quick brown fox jumps over the lazy dog"  # a few tokens: the frontend, not prefill, is measured
POLL_S = 0.01
IDLE_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: a fresh tiny-llama in a temp dir)")
    parser.add_argument("--workers", type=int, default=4, help="mock workers behind the frontend")
    parser.add_argument("--connections", type=int, default=64, help="wrk connections (concurrent requests)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--duration", type=int, default=10, help="seconds of each measured wrk run")
    parser.add_argument("--warmup", type=int, default=2, help="seconds of wrk warm-up before each run (0: none)")
    parser.add_argument("--stream-tokens", type=int, default=16, help="max_tokens of the streaming run")
    parser.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                        help="extra flag for tokenmill serve, repeatable (e.g. --serve-flag=--router=round-robin)")
    parser.add_argument("--start-timeout-s", type=float, default=120.0, help="wait for the first 200 and the workers")
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")


def _validate(args: argparse.Namespace) -> None:
    for name in ("workers", "connections", "threads", "duration", "stream_tokens", "start_timeout_s"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.connections < args.threads:
        raise ValueError("wrk needs --connections >= --threads")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no config.json there")


def bodies(stream_tokens: int) -> dict[str, dict[str, Any]]:
    """The request body of each load run, by run name."""
    base = {"model": SERVED_NAME, "prompt": PROMPT}
    return {"non_streaming": {**base, "max_tokens": 1},
            "streaming": {**base, "max_tokens": stream_tokens, "ignore_eos": True, "stream": True}}


def serve_argv(args: argparse.Namespace, model: str, port: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", "--model", model,
            "--runner", "mock", "--mock-step-time", "0,0,0,0", "--workers", str(args.workers),
            "--served-model-name", SERVED_NAME, "--host", HOST, "--port", str(port), "--run-dir", str(run_dir),
            *args.serve_flag]


def launch(argv: list[str], url: str, run_dir: Path, log_path: Path, args: argparse.Namespace
           ) -> tuple[ServeProcess, float, float]:
    """Start serve in its own process group; return it, when Popen was called (perf_counter) and
    the seconds to its first 200. Not start_serve: its 200 ms health polls would blur the figure."""
    run_dir.mkdir(parents=True, exist_ok=True)
    body = bodies(args.stream_tokens)["non_streaming"]
    # the client exists before Popen, so its set-up is not part of the start-up time
    with httpx.Client(trust_env=False, timeout=5.0) as client, open(log_path, "ab") as server_log:
        start = time.perf_counter()
        process = subprocess.Popen(argv, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)
        server = ServeProcess(url, run_dir, process, args.workers)
        try:
            return server, start, _first_200(client, server, body, start, args.start_timeout_s)
        except RuntimeError as exc:
            stop(server)
            tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
            raise RuntimeError(f"{exc}; its log ends:\n{tail}") from exc
        except BaseException:  # Ctrl-C while polling: still no orphaned server
            stop(server)
            raise


def _first_200(client: httpx.Client, server: ServeProcess, body: dict[str, Any], start: float,
               timeout_s: float) -> float:
    while time.perf_counter() - start < timeout_s:
        if server.process.poll() is not None:
            raise RuntimeError(f"tokenmill serve exited with {server.process.returncode} before answering")
        try:
            if client.post(server.url + "/v1/completions", json=body).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(POLL_S)
    raise RuntimeError(f"tokenmill serve answered no completion within {timeout_s:.0f} s")


def _wait_all_workers(server: ServeProcess, start: float, timeout_s: float) -> float:
    """Seconds from Popen until every worker is registered and connected (the first 200 needs one)."""
    while not server.healthy():
        if time.perf_counter() - start > timeout_s:
            raise RuntimeError(f"not all {server.num_workers} workers connected within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return time.perf_counter() - start


def serving_roles(server: ServeProcess) -> dict[int, str]:
    pids = [int(e["pid"]) for e in server.registry() if str(e.get("pid", "")).isdigit()]
    return procs.classify(server.process.pid, pids)


def idle_rss(server: ServeProcess) -> dict[str, Any]:
    rows = [{"pid": pid, "role": role, "mib": kib / 1024}
            for pid, role in sorted(serving_roles(server).items()) if (kib := procs.rss_kib(pid)) is not None]
    return {"total_mib": sum(r["mib"] for r in rows), "processes": rows}


def load_run(name: str, body: dict[str, Any], server: ServeProcess, wrk: str, args: argparse.Namespace,
             work: Path) -> tuple[LoadResult, list[str]]:
    """A warm-up, then the measured wrk run with CPU snapshots of every serving process around it."""
    script = work / f"{name}.lua"
    script.write_text(lua_script(body), encoding="utf-8")
    url = server.url + "/v1/completions"
    if args.warmup:
        warm = run_wrk(wrk_argv(wrk, url, script, args.threads, args.connections, args.warmup), args.warmup)
        if warm.total_errors:
            log.warning("%s warm-up: %d errors %s", name, warm.total_errors, warm.errors)
    argv = wrk_argv(wrk, url, script, args.threads, args.connections, args.duration)
    roles = serving_roles(server)
    before = procs.cpu_snapshot(roles)
    result = run_wrk(argv, args.duration)
    roles.update(serving_roles(server))  # and any process started during the run
    cpu = procs.cpu_by_role(before, procs.cpu_snapshot(roles), roles)
    log.info("%s: %d requests in %.1f s, %d errors", name, result.requests, result.duration_s, result.total_errors)
    return LoadResult.of(result, cpu[procs.FRONTEND], cpu[procs.WORKER]), argv


def measure(args: argparse.Namespace, wrk: str, work: Path) -> dict[str, Any]:
    model = args.model or _make_model(work / "tiny-llama")
    port, run_dir = free_port(), work / "run"
    argv = serve_argv(args, model, port, run_dir)
    server, start, first_200_s = launch(argv, f"http://{HOST}:{port}", run_dir, work / "serve.log", args)
    try:
        startup = {"first_200_s": first_200_s, "all_workers_s": _wait_all_workers(server, start, args.start_timeout_s)}
        time.sleep(IDLE_S)
        rss = idle_rss(server)
        runs, wrk_argvs = {}, {}
        for name, body in bodies(args.stream_tokens).items():
            result, wrk_argvs[name] = load_run(name, body, server, wrk, args, work)
            runs[name] = asdict(result)
    finally:
        stop(server)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
    config.update(model=model, serve_argv=argv, wrk_argv=wrk_argvs, cpu_count=os.cpu_count())
    report = {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, "config": config,
              "startup": startup, "idle_rss": rss, "runs": runs}
    report["targets"] = target_checks(report, TARGETS)
    return report


def _make_model(out: Path) -> str:
    from tokenmill.engine.make_model import write_model

    log.info("writing tiny-llama to %s", out)
    return str(write_model("tiny-llama", out, seed=0))


def run(args: argparse.Namespace) -> int:
    """0 when every measured request succeeded, 1 otherwise (or no server / wrk failed), 2 for bad
    flags or no wrk. Speed never decides the exit code."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
    wrk = shutil.which("wrk")
    if wrk is None:
        log.error("bench frontend: wrk is not installed (on Debian/Ubuntu: apt-get install wrk)")
        return 2
    try:
        _validate(args)
    except ValueError as exc:
        log.error("bench frontend: %s", exc)
        return 2
    with tempfile.TemporaryDirectory(prefix="tokenmill-frontend-bench-") as work:
        try:
            report = measure(args, wrk, Path(work))
        except RuntimeError as exc:
            log.error("bench frontend: %s", exc)
            return 1
    render(report)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log.info("wrote %s", args.json_path)
    return 0 if all(r["errors_total"] == 0 for r in report["runs"].values()) else 1
