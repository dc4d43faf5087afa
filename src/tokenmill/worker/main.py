"""`tokenmill worker`: run one worker process (engine + request socket + heartbeats)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.engine.cli_args import add_engine_arguments

    add_engine_arguments(parser)
    parser.add_argument("--worker-id", default="worker-0")
    parser.add_argument("--address", default="tcp://127.0.0.1:0",
                        help="where to listen: ipc:///path or tcp://host:port (port 0 picks one)")
    parser.add_argument("--discovery", default="file:.tokenmill/registry",
                        help="file:DIR (a registry directory shared with the frontend)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-queue", type=int, default=None,
                        help="requests that may wait beyond a full batch before 'overloaded'")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process exits")
    parser.add_argument("--events-address", default=None,
                        help="publish KV events here (ipc:// or tcp://host:0); default: not published")


def run(args: argparse.Namespace) -> int:
    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.engine.cli_args import engine_config_from_args
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.runtime.discovery import discovery_from_url
    from tokenmill.worker.server import WorkerServer, WorkerSettings

    try:
        config = engine_config_from_args(args, args.worker_id)
        discovery = discovery_from_url(args.discovery)
        engine = AsyncLLMEngine(LLMEngine(config))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model
    server = WorkerServer(engine, WorkerSettings(args.worker_id, args.address, name, max_queue=args.max_queue,
                                                   parent_pid=args.parent_pid, events_address=args.events_address),
                          discovery)
    address = server.bind()
    log.info("worker %s serving %s on %s", args.worker_id, name, address)
    asyncio.run(_serve(server))
    return 0


async def _serve(server) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)
    await server.serve()
