"""The `tokenmill` command: one sub-command per job.

Each sub-command lives in the package that owns the job. Its module exposes
`add_arguments(parser)` and `run(args) -> int`; it must import heavy libraries
(torch, transformers) inside `run`, so `tokenmill --help` and `tokenmill sim …`
stay fast.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from tokenmill.openmp_env import tune_for_own_engine

# (name, module, one-line help)
SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("make-model", "tokenmill.engine.make_model", "write a small random-weight HF-format checkpoint"),
    ("convert-gguf", "tokenmill.engine.gguf_convert", "convert a llama GGUF file to an HF-format checkpoint"),
    ("generate", "tokenmill.engine.generate_cli", "generate text in-process with the embedded engine"),
    ("serve", "tokenmill.serve_cli", "serve the OpenAI API: one frontend and N worker processes"),
    ("worker", "tokenmill.worker.main", "run one worker process (for multi-host deployments)"),
    ("frontend", "tokenmill.api.frontend_cli", "run the HTTP frontend alone, finding workers via discovery"),
    ("bench", "tokenmill.bench.cli", "benchmarks that print a table and write JSON"),
    ("sim", "tokenmill.sim.cli", "performance simulator and deployment search"),
    ("planner", "tokenmill.planner.cli", "SLA planner: backtest predictors, simulate, run against a deployment"),
)


def add_subcommands(parser: argparse.ArgumentParser, table: tuple[tuple[str, str, str], ...], dest: str,
                    run_attr: str, argv: list[str] | None = None) -> None:
    """One sub-parser per (name, module, help) row; the module's `run` is stored as `run_attr`.

    When `argv` names one of them, only that module is imported (the others stay bare
    sub-parsers, enough for the usage line): a worker process starts without importing the
    frontend, the benchmarks and the simulator."""
    chosen = next((arg for arg in argv or () if arg in {row[0] for row in table}), None)
    sub = parser.add_subparsers(dest=dest, metavar=dest.upper(), required=True)
    for name, module_name, help_text in table:
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if chosen is not None and name != chosen:
            continue
        module = importlib.import_module(module_name)
        module.add_arguments(cmd)
        cmd.set_defaults(**{run_attr: module.run})


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)")
    add_subcommands(parser, SUBCOMMANDS, "command", "_run", argv)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tune_for_own_engine(os.environ)  # before any sub-command imports torch
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
