"""`tokenmill bench structured`: the per-token cost of `json_schema` decoding against plain decoding.

The embedded engine (torch runner, small-moe by default) decodes a batch of requests twice per
round: plain, and under a JSON-schema grammar (an extraction-style schema, compiled as the
frontend compiles `response_format`). Only decode steps in which the whole batch still runs are
timed (a structured answer may end early, and a smaller batch costs less per step), so the
difference is the grammar's: the masks (computed beside the forward pass, `engine/guided.py`),
applying them, and advancing the matchers. Reported: ms per output token each way, the overhead
per token, the masks' own compute time per step, and the one-off cost of compiling a schema and
building a matcher. JSON with `--json OUT` (schema "tokenmill.bench.structured").
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.bench.harness.checkpoint import model_or_small_moe

SCHEMA_NAME, SCHEMA_VERSION = "tokenmill.bench.structured", 1
WAYS = ("plain", "json_schema")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: a fresh small-moe in a temp dir)")
    parser.add_argument("--batch", type=int, default=8, help="requests decoded together")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each way, alternating")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")


# An extraction-style answer: a free string, a bounded list of short strings and a number.
SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["summary", "tags", "score"],
    "properties": {"summary": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 24},
                                                           "maxItems": 8},
                   "score": {"type": "integer", "minimum": 0, "maximum": 100}}}


def _decode(engine: Any, prompts: list[list[int]], params: Any) -> tuple[float, int, int]:
    """(seconds, tokens, steps) of the decode steps in which every request of the batch was still
    running: a structured answer may end early, and a smaller batch costs less per step."""
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while any(len(engine.requests[rid].output_token_ids) == 0 for rid in ids):
        engine.step()  # prefill (and the first token) off the clock: the grammar changes nothing there
    seconds, tokens, steps = 0.0, 0, 0
    while all(rid in engine.requests for rid in ids):
        started = time.perf_counter()
        outputs = engine.step()
        seconds += time.perf_counter() - started
        tokens, steps = tokens + sum(len(out.new_token_ids) for out in outputs), steps + 1
    for rid in ids:
        engine.abort(rid)
    return seconds, tokens, steps


def _measure(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.api.structured import response_format_grammar
    from tokenmill.textgen.sampling import SamplingParams

    started = time.perf_counter()
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    engine.grammars.matcher(grammar)
    matcher_s = time.perf_counter() - started
    rng = random.Random(0)
    figures: dict[str, list[float]] = {way: [] for way in WAYS}
    steps_measured: dict[str, list[int]] = {way: [] for way in WAYS}
    mask_s_per_step: list[float] = []
    for round_index in range(args.rounds):
        for way in WAYS:
            prompts = [[rng.randint(3, 2000) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
            params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=round_index, ignore_eos=True,
                                    grammar=grammar if way == "json_schema" else None)
            masks = engine.runner.mask_computer
            before = masks.compute_seconds if masks is not None else 0.0
            seconds, tokens, steps = _decode(engine, prompts, params)
            if not steps:
                continue  # a structured answer ended on its first token: nothing at full batch to time
            figures[way].append(seconds / tokens)
            steps_measured[way].append(steps)
            if way == "json_schema":
                mask_s_per_step.append((engine.runner.mask_computer.compute_seconds - before) / steps)
    if not figures["json_schema"]:
        raise RuntimeError("every structured round ended at once: raise --batch or --rounds")
    return {"s_per_token": figures, "steps": steps_measured, "mask_s_per_step": mask_s_per_step,
            "compile_s": compile_s, "matcher_s": matcher_s}


def _report(measured: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    plain, guided = (statistics.median(measured["s_per_token"][way]) for way in WAYS)
    return {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
            "config": {k: getattr(args, k) for k in ("model", "batch", "prompt_tokens", "max_tokens", "rounds")},
            "ms_per_token": {"plain": plain * 1e3, "json_schema": guided * 1e3},
            "output_tokens_per_s": {"plain": 1 / plain, "json_schema": 1 / guided},
            "overhead_us_per_token": (guided - plain) * 1e6, "overhead_ratio": guided / plain,
            "mask_us_per_step": statistics.median(measured["mask_s_per_step"]) * 1e6,
            "steps_timed": {way: sum(measured["steps"][way]) for way in WAYS},
            "schema_compile_ms": measured["compile_s"] * 1e3, "matcher_build_ms": measured["matcher_s"] * 1e3,
            "raw": measured}


def _print(report: dict[str, Any]) -> None:
    cfg = report["config"]
    table = Table(title=f"bench structured: batch {cfg['batch']}, up to {cfg['max_tokens']} tokens each, "
                        f"{cfg['rounds']} rounds (median)")
    for column in ("way", "ms per output token", "output tok/s", "full-batch steps timed"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for way in WAYS:
        table.add_row(way, f"{report['ms_per_token'][way]:.3f}", f"{report['output_tokens_per_s'][way]:.1f}",
                      str(report["steps_timed"][way]))
    console = Console()
    console.print(table)
    console.print(f"json_schema / plain: {report['overhead_ratio']:.3f}x time per token "
                  f"({report['overhead_us_per_token']:+.0f} us per token); masks {report['mask_us_per_step']:.0f} us "
                  f"per step (beside the forward pass); schema compile {report['schema_compile_ms']:.2f} ms, "
                  f"matcher {report['matcher_build_ms']:.2f} ms")


def run(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.rounds < 1 or args.prompt_tokens < 1 or args.max_tokens < 2:
        print("error: --batch >= 1, --rounds >= 1, --prompt-tokens >= 1, --max-tokens >= 2")
        return 2
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    with tempfile.TemporaryDirectory(prefix="tokenmill-structured-") as tmp:
        args.model = model_or_small_moe(args.model, Path(tmp))
        engine = LLMEngine(EngineConfig(model=args.model, threads=args.threads,
                                        max_num_seqs=max(args.batch, 1)))
        report = _report(_measure(engine, args), args)
    _print(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0
