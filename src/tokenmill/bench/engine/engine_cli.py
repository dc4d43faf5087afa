"""`tokenmill bench engine`: the engine against transformers' generate() (`engine_bench`), or,
with `--deterministic`, the engine with its batch-invariant kernels against itself without them
(`deterministic_bench`)."""
from __future__ import annotations

import argparse

from tokenmill.bench.engine import deterministic_bench, engine_bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    engine_bench.add_arguments(parser)
    parser.add_argument("--deterministic", action="store_true",
                        help="instead: the engine with --deterministic against the default engine, the same "
                             "workloads in turn (a new one each round), and the ratio of their output tok/s")
    parser.add_argument("--rounds", type=int, default=2, help="with --deterministic: workloads run on both sides")


def run(args: argparse.Namespace) -> int:
    return deterministic_bench.run(args) if args.deterministic else engine_bench.run(args)
