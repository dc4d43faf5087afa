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
import sys

# (name, module, one-line help)
SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("make-model", "tokenmill.engine.make_model", "write a small random-weight HF-format checkpoint"),
    ("generate", "tokenmill.engine.generate_cli", "generate text in-process with the embedded engine"),
    ("serve", "tokenmill.frontend.serve_command", "serve the OpenAI API: one frontend and N worker processes"),
    ("worker", "tokenmill.worker.main", "run one worker process (for multi-host deployments)"),
    ("frontend", "tokenmill.frontend.frontend_command", "run the HTTP frontend alone, finding workers via discovery"),
    ("bench", "tokenmill.bench.cli", "benchmarks that print a table and write JSON"),
    ("sim", "tokenmill.sim.cli", "performance simulator and deployment search"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name, help_text in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # a sub-command whose package is not built yet
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
