"""`tokenmill planner COMMAND …`: one nested sub-command per planner job.

Each command is one module exposing `add_arguments(parser)` and `run(args) -> int`,
registered in `COMMANDS` below, exactly like the top-level `tokenmill` sub-commands.
The modules import statsmodels, numpy and the simulator inside `run`, so
`tokenmill planner --help` stays fast.
"""
from __future__ import annotations

import argparse

from tokenmill.cli import add_subcommands

# (name, module, one-line help)
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("backtest", "tokenmill.planner.backtest",
     "load predictors one step ahead on a trace: MAPE of requests, mean ISL and OSL per interval"),
    ("run", "tokenmill.planner.run_cli",
     "the planner against a running tokenmill serve: observe /metrics, scale through /admin/workers"),
    ("simulate", "tokenmill.planner.simulate",
     "the planner sizing a simulated fleet over a trace, beside static-peak and oracle baselines"),
    ("choose", "tokenmill.planner.choose",
     "which shape (agg, disagg at each threshold) and planner mode serve a load at the fewest GPU-hours"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # not `_run`: the top-level parser already uses that name for `planner` itself
    add_subcommands(parser, COMMANDS, "planner_command", "_planner_run")


def run(args: argparse.Namespace) -> int:
    return int(args._planner_run(args) or 0)
