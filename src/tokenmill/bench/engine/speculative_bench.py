"""`tokenmill bench speculative`: the embedded engine with and without speculative decoding (n-gram
drafts, or a draft model's with `--speculative draft:DIR`), on a code load with repeated spans.

The load is code editing as an agent sends it: each request asks the model to add a docstring to
one Python function and return the whole function, so most of the answer copies the prompt. The
functions are tokenmill's own, drawn seeded from a snapshot shipped in `datasets/code/` (64
top-level functions of 8 to 40 lines), so that the load stays the same from one commit to the
next. Both engines load the same checkpoint in
this process and run the same prompt ids greedily, alternating (plain, speculative, plain, ...);
the texts must be identical. Reported: output tok/s of each side and their ratio, drafts
accepted per drafted, and tokens a request emits per decode step, the figure the simulator takes
as `sim --mtp K --mtp-acceptance X`. JSON with `--json OUT` (schema "tokenmill.bench.speculative").
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.datasets import CODE_FUNCTIONS, SHIPPED

log = logging.getLogger(__name__)

SCHEMA_NAME, SCHEMA_VERSION = "tokenmill.bench.speculative", 1
SIDES = ("plain", "speculative")
INSTRUCTION = "Add a docstring to this Python function and return the whole function."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=".models/smollm2-135m-instruct",
                        help="checkpoint dir with a chat template (default: the one `make serve` prepares)")
    parser.add_argument("--num-requests", type=int, default=8, help="functions to edit, all sent at once")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--speculative", default="ngram", metavar="ngram|draft:DIR",
                        help="the drafts: prompt lookup (default) or a draft model with the same tokenizer")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="which functions are drawn")
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")


def code_prompts(count: int, seed: int) -> list[str]:
    """`count` editing requests over the shipped functions (all of them when count is larger)."""
    lines = (SHIPPED / CODE_FUNCTIONS).read_text(encoding="utf-8").splitlines()
    functions = [json.loads(line)["code"] for line in lines]
    picked = random.Random(seed).sample(functions, min(count, len(functions)))
    return [f"{INSTRUCTION}\n```python\n{code}\n```" for code in picked]


def _engines(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig.parse(args.speculative, args.num_speculative_tokens)
    return {side: LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, threads=args.threads,
                                         speculative=spec if side == "speculative" else None))
            for side in SIDES}


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.textgen.sampling import SamplingParams

    engines = _engines(args)
    tokenizer = engines["plain"].tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}])
               for text in code_prompts(args.num_requests, args.seed)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for engine in engines.values():  # first-call costs out of the measured runs
        engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    outputs: dict[str, list[list[int]]] = {}
    for round_index in range(args.rounds):
        for side in SIDES:
            runs[side].append(_run(engines[side], prompts, params, outputs, side))
            log.info("round %d, %s: %.1f output tok/s", round_index, side, runs[side][-1]["output_tokens_per_s"])
    if outputs["plain"] != outputs["speculative"]:
        raise RuntimeError("speculative decoding changed the greedy output")
    return {"prompt_tokens": [len(p) for p in prompts], "runs": runs}


def _run(engine: Any, prompts: list[list[int]], params: Any, outputs: dict[str, list[list[int]]],
         side: str) -> dict[str, float]:
    before = engine.stats()
    started = time.perf_counter()
    out = engine.generate(prompts, params)
    wall = time.perf_counter() - started
    after = engine.stats()
    outputs[side] = out
    tokens = sum(map(len, out))
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    # a request's decode steps (its first token came from its prefill), counted per request
    decode_seq_steps = after.decode_tokens - before.decode_tokens
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "steps": after.num_steps - before.num_steps, "drafted": drafted, "accepted": accepted,
            "tokens_per_decode_step": (tokens - len(prompts)) / max(1, decode_seq_steps)}


def _report(measured: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    sides = {}
    for side, runs in measured["runs"].items():
        sides[side] = {"median_output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in runs),
                       "runs": runs}
    spec_run = measured["runs"]["speculative"][-1]
    drafted, accepted = spec_run["drafted"], spec_run["accepted"]
    plain_rate = sides["plain"]["median_output_tokens_per_s"]
    return {
        "schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
        "config": {k: getattr(args, k) for k in ("model", "num_requests", "max_tokens", "speculative",
                                                 "num_speculative_tokens", "rounds", "dtype", "threads", "seed")},
        "prompt_tokens": measured["prompt_tokens"], "sides": sides,
        "throughput_ratio": sides["speculative"]["median_output_tokens_per_s"] / plain_rate,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_decode_step": spec_run["tokens_per_decode_step"],
        "steps_ratio": measured["runs"]["plain"][-1]["steps"] / max(1, spec_run["steps"]),
    }


def _print(report: dict[str, Any]) -> None:
    c = report["config"]
    table = Table(title=f"bench speculative: {c['num_requests']} code edits, {c['max_tokens']} tokens, "
                        f"{c['speculative']} K={c['num_speculative_tokens']}, {c['dtype']}")
    for column in ("side", "output tok/s (median)", "runs", "engine steps"):
        table.add_column(column, justify="left" if column == "side" else "right")
    for side, figures in report["sides"].items():
        rates = ", ".join(f"{r['output_tokens_per_s']:.1f}" for r in figures["runs"])
        table.add_row(side, f"{figures['median_output_tokens_per_s']:.1f}", rates, str(figures["runs"][-1]["steps"]))
    console = Console()
    console.print(table)
    console.print(f"speculative / plain: {report['throughput_ratio']:.2f}x output tok/s at the same text; "
                  f"{report['acceptance_rate']:.0%} of drafts accepted; {report['steps_ratio']:.2f}x fewer steps")
    console.print(f"the simulator's equivalent: sim --mtp {c['num_speculative_tokens']} --mtp-acceptance "
                  f"{report['tokens_per_decode_step']:.2f} (its default, 1.0, prices no speculation)")


def run(args: argparse.Namespace) -> int:
    checks = (("--num-requests", args.num_requests >= 1), ("--max-tokens", args.max_tokens >= 1),
              ("--rounds", args.rounds >= 1), ("--threads", args.threads is None or args.threads >= 1))
    for flag, ok in checks:
        if not ok:
            log.error("bench speculative: %s must be at least 1", flag)
            return 2
    if not (Path(args.model) / "config.json").is_file():
        log.error("bench speculative: --model %s: not a model directory (no config.json; `make serve` "
                  "prepares the default)", args.model)
        return 2
    try:
        report = _report(_measure(args), args)
    except ValueError as exc:  # a bad --speculative or --num-speculative-tokens, no chat template
        log.error("bench speculative: %s", exc)
        return 2
    _print(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0
