"""`tokenmill serve` (frontend + N supervised worker processes) and `tokenmill frontend`
(the HTTP frontend alone, finding workers through discovery)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.engine.cli_args import add_engine_arguments

    add_engine_arguments(parser)
    parser.add_argument("--workers", type=int, default=1, help="aggregated worker processes")
    _add_frontend_flags(parser)
    parser.add_argument("--max-queue", type=int, default=None,
                        help="requests a worker may hold waiting beyond a full batch before 429")
    parser.add_argument("--run-dir", default=None,
                        help="directory for worker sockets and the registry (default: a fresh temp dir)")


def _add_frontend_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="model id in the API (default: the directory name)")
    parser.add_argument("--usd-per-worker-hour", type=float, default=0.0)
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="deadline of every request")
    parser.add_argument("--router", default=None, choices=["kv", "kv-approx", "round-robin", "random", "least-loaded"],
                        help="how requests are routed to workers (default: kv with several workers)")
    parser.add_argument("--router-temperature", type=float, default=0.0,
                        help="> 0 samples workers with softmax over normalised costs")


def run_serve(args: argparse.Namespace) -> int:
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
    import os

    from tokenmill.runtime.discovery import FileDiscovery
    from tokenmill.runtime.supervisor import ChildSpec, Supervisor

    registry = run_dir / "registry"
    discovery = FileDiscovery(registry)
    events = _router_policy(args) == "kv"
    specs = [ChildSpec(f"worker-{i}", [sys.executable, "-m", "tokenmill.cli", "--log-level", args.log_level,
                                       "worker", *engine_args, "--worker-id", f"worker-{i}",
                                       "--address", f"ipc://{run_dir}/worker-{i}.sock",
                                       *(["--events-address", f"ipc://{run_dir}/worker-{i}-events.sock"]
                                         if events else []),
                                       "--discovery", f"file:{registry}", "--parent-pid", str(os.getpid()),
                                       *(["--max-queue", str(args.max_queue)] if args.max_queue is not None else []),
                                       "--served-model-name", _model_name(args)])
             for i in range(args.workers)]
    backend = _backend(args, discovery)
    supervisor = Supervisor(specs, on_exit=lambda name: _worker_died(backend, discovery, name))
    supervisor.start()
    watcher = asyncio.create_task(supervisor.watch())
    try:
        await _run_http(args, backend)
    finally:
        watcher.cancel()
        supervisor.stop()
    return 0


def _worker_died(backend, discovery, name: str) -> None:
    discovery.unregister(name)
    backend.pool.drop(name, "process exited")


def _router_policy(args: argparse.Namespace) -> str:
    if args.router is not None:
        return args.router
    return "kv" if getattr(args, "workers", 2) > 1 else "least-loaded"


def _model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or Path(args.model).resolve().name


def _backend(args: argparse.Namespace, discovery):
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.frontend.distributed_backend import DistributedBackend
    from tokenmill.frontend.worker_pool import WorkerPool
    from tokenmill.router.cost import CostConfig
    from tokenmill.router.policies import Router, RouterConfig

    config = load_model_config(args.model)
    limit = args.max_model_len or config.max_position_embeddings
    router = Router(RouterConfig(policy=_router_policy(args), block_size=getattr(args, "block_size", 16),
                                 cost=CostConfig(temperature=args.router_temperature)))
    return DistributedBackend(WorkerPool(discovery, router), Tokenizer(args.model), _model_name(args), limit,
                              default_timeout_s=args.request_timeout_s)


async def _run_http(args: argparse.Namespace, backend) -> None:
    import uvicorn

    from tokenmill.frontend.app import create_app

    app = create_app(backend, _model_name(args), usd_per_worker_hour=args.usd_per_worker_hour or None,
                     request_timeout_s=args.request_timeout_s)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    log.info("serving %s on http://%s:%d", _model_name(args), args.host, args.port)
    await server.serve()


def add_frontend_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (for the tokenizer and config)")
    parser.add_argument("--discovery", required=True, help="file:DIR shared with the workers")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--log-level-http", default="warning")
    _add_frontend_flags(parser)


def run_frontend(args: argparse.Namespace) -> int:
    from tokenmill.runtime.discovery import discovery_from_url

    try:
        discovery = discovery_from_url(args.discovery)
        backend = _backend(args, discovery)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_run_http(args, backend))
    except KeyboardInterrupt:
        pass
    return 0
