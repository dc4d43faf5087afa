"""`tokenmill serve`: one HTTP frontend and N supervised worker processes on this host."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tokenmill.frontend.launch import add_frontend_flags, make_backend, model_name, router_policy, run_http

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.engine.cli_args import add_engine_arguments

    add_engine_arguments(parser)
    parser.add_argument("--workers", type=int, default=1, help="aggregated worker processes")
    add_frontend_flags(parser)
    parser.add_argument("--max-queue", type=int, default=None,
                        help="requests a worker may hold waiting beyond a full batch before 429")
    parser.add_argument("--run-dir", default=None,
                        help="directory for worker sockets and the registry (default: a fresh temp dir)")


def run(args: argparse.Namespace) -> int:
    from tokenmill.engine.cli_args import engine_argv, engine_config_from_args

    try:
        engine_config_from_args(args)  # flag errors here, not in N workers
        if args.workers < 1:
            raise ValueError("--workers must be at least 1")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="tokenmill-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        return asyncio.run(_serve(args, run_dir, engine_argv(args)))
    except KeyboardInterrupt:
        return 0
    finally:
        if not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


async def _serve(args: argparse.Namespace, run_dir: Path, engine_args: list[str]) -> int:
    from tokenmill.runtime.discovery import FileDiscovery
    from tokenmill.runtime.supervisor import ChildSpec, Supervisor

    registry = run_dir / "registry"
    discovery = FileDiscovery(registry)
    specs = [ChildSpec(f"worker-{i}", _worker_argv(args, i, run_dir, engine_args)) for i in range(args.workers)]
    backend = make_backend(args, discovery)
    supervisor = Supervisor(specs, on_exit=lambda name: _worker_died(backend, discovery, name))
    supervisor.start()
    watcher = asyncio.create_task(supervisor.watch())
    try:
        await run_http(args, backend)
    finally:
        watcher.cancel()
        supervisor.stop()
    return 0


def _worker_argv(args: argparse.Namespace, index: int, run_dir: Path, engine_args: list[str]) -> list[str]:
    name = f"worker-{index}"
    argv = [sys.executable, "-m", "tokenmill.cli", "--log-level", args.log_level, "worker", *engine_args,
            "--worker-id", name, "--address", f"ipc://{run_dir}/{name}.sock",
            "--discovery", f"file:{run_dir / 'registry'}", "--parent-pid", str(os.getpid()),
            "--served-model-name", model_name(args)]
    if router_policy(args) == "kv":  # only the KV router consumes events
        argv += ["--events-address", f"ipc://{run_dir}/{name}-events.sock"]
    if args.max_queue is not None:
        argv += ["--max-queue", str(args.max_queue)]
    return argv


def _worker_died(backend, discovery, name: str) -> None:
    discovery.unregister(name)
    backend.pool.drop(name, "process exited")


