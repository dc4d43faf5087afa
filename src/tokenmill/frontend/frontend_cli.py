"""`tokenmill frontend`: the HTTP frontend alone, finding workers through discovery
(for deployments where workers run on other hosts or are started separately)."""
from __future__ import annotations

import argparse
import sys

from tokenmill.frontend.launch import add_frontend_flags, make_backend, run_http
from tokenmill.runtime import event_loop


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (for the tokenizer and config)")
    parser.add_argument("--discovery", required=True, help="file:DIR shared with the workers")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--log-level-http", default="warning")
    add_frontend_flags(parser)


def run(args: argparse.Namespace) -> int:
    from tokenmill.runtime.discovery import discovery_from_url

    try:
        discovery = discovery_from_url(args.discovery)
        backend = make_backend(args, discovery)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        event_loop.run(run_http(args, backend))
    except KeyboardInterrupt:
        pass
    return 0
