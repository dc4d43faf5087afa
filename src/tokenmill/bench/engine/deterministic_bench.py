"""`tokenmill bench engine --deterministic`: what the batch-invariant kernels cost.

Two engines on the same model, one with `--deterministic`, run the same seeded workload (the
bench's own, greedy) in turn: each round draws a new workload (seed + round, so that no prompt is
served from the prefix cache of the round before) and runs it on both, the first side swapped
every round. The ratio is the deterministic side's output tok/s over the default side's, each
side's tokens and seconds summed over the rounds; its mean decode step over the default's too.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.engine.engine_bench import EngineBenchConfig, make_workload, run_tokenmill, warm_up
from tokenmill.bench.harness.report_file import write_json

log = logging.getLogger(__name__)

SIDES = ("default", "deterministic")


@dataclass(slots=True)
class SideRun:
    side: str
    round: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    mean_decode_step_ms: float
    decode_only_steps: int


@dataclass(slots=True)
class DeterministicReport:
    config: dict[str, Any]
    runs: list[SideRun]

    def total(self, side: str, field: str) -> float:
        return sum(getattr(r, field) for r in self.runs if r.side == side)

    @property
    def tokens_per_s_ratio(self) -> float:
        rate = {s: self.total(s, "output_tokens") / self.total(s, "wall_s") for s in SIDES}
        return rate["deterministic"] / rate["default"]

    @property
    def decode_step_ratio(self) -> float:
        mean = {s: self.total(s, "mean_decode_step_ms") / max(1, sum(r.side == s for r in self.runs)) for s in SIDES}
        return mean["deterministic"] / mean["default"]

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "runs": [dataclasses.asdict(r) for r in self.runs],
                "output_tokens_per_s_ratio": self.tokens_per_s_ratio, "decode_step_ratio": self.decode_step_ratio}


def run_deterministic_bench(cfg: EngineBenchConfig, rounds: int) -> DeterministicReport:
    if rounds <= 0:
        raise ValueError(f"--rounds must be positive, got {rounds}")
    engines = {side: cfg.engine(deterministic=side == "deterministic") for side in SIDES}
    try:
        first = engines["default"]
        special = first.tokenizer.special_token_ids if first.tokenizer else frozenset()
        runs = []
        for i in range(rounds):
            workload = make_workload(dataclasses.replace(cfg, seed=cfg.seed + i), first.model_config.vocab_size, special)
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                if i == 0:
                    warm_up(engines[side], workload)
                result, _ = run_tokenmill(engines[side], workload, warm=True)
                runs.append(SideRun(side, i, result.output_tokens, result.wall_s, result.output_tokens_per_s,
                                    result.mean_decode_step_ms, result.decode_only_steps))
    finally:
        for engine in engines.values():
            engine.close()
    return DeterministicReport(dataclasses.asdict(cfg) | {"rounds": rounds}, runs)


def render(report: DeterministicReport) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tokenmill bench engine --deterministic — {report.config['model']} ({report.config['dtype']})")
    for column in ("round", "side", "output tok/s", "decode step ms", "decode steps"):
        table.add_column(column, justify="right")
    for r in report.runs:
        table.add_row(str(r.round), r.side, f"{r.output_tokens_per_s:.1f}", f"{r.mean_decode_step_ms:.1f}",
                      str(r.decode_only_steps))
    table.add_row("all", "deterministic ÷ default", f"{report.tokens_per_s_ratio:.3f}×", f"{report.decode_step_ratio:.3f}×",
                  "")
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    fields = EngineBenchConfig.__dataclass_fields__
    try:
        cfg = EngineBenchConfig(**{name: getattr(args, name) for name in fields})
        report = run_deterministic_bench(cfg, args.rounds)
    except (ValueError, FileNotFoundError) as exc:
        log.error("bench engine --deterministic: %s", exc)
        return 2
    render(report)
    if cfg.json_path:
        write_json(report.to_json(), cfg.json_path)
        log.info("wrote %s", cfg.json_path)
    return 0
