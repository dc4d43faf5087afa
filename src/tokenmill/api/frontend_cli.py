"""`tokenmill frontend`: the HTTP frontend alone, finding workers through discovery
(for deployments where workers run on other hosts or are started separately)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from tokenmill.api.launch import add_frontend_flags, fleet_queue, make_backend, run_http, tenants_from
from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE
from tokenmill.runtime import event_loop


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (for the tokenizer and config)")
    parser.add_argument("--discovery", required=True, help="file:DIR shared with the workers, or etcd://host:port[,host:port][/prefix]")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="the workers' KV block size (the router hashes by it)")
    parser.add_argument("--log-level-http", default="warning")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process exits")
    add_frontend_flags(parser)


def run(args: argparse.Namespace) -> int:
    from tokenmill.runtime.discovery import discovery_from_url

    try:
        tenants_from(args)
        fleet_queue(args)
        discovery = discovery_from_url(args.discovery)
        backend = make_backend(args, discovery)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.parent_pid is not None:
        threading.Thread(target=_stop_with_parent, args=(args.parent_pid,), daemon=True).start()
    try:
        event_loop.run(run_http(args, backend))
    except KeyboardInterrupt:
        pass
    return 0


def _stop_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """An API server `tokenmill serve` started must not outlive it (it would hold the port)."""
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown
