"""`tokenmill bench engines`: serving engines compared on the same load (`engines_sides` has the
servers of each comparison, `engines_report` the figures).

- layer: `tokenmill serve --engine vllm` (frontend + 1 vLLM worker) vs vLLM's own OpenAI server.
  Targets: output tok/s tokenmill / vLLM >= 0.95, TTFT p50 tokenmill / vLLM <= 1.1.
- routing: `tokenmill serve --engine vllm --workers 2`, `--router kv` vs `round-robin`, on
  prefix-routing's shared-prefix load. Targets: mean TTFT rr / kv >= 1.5, p99 TTFT kv / rr <= 1.1.
- engines: tokenmill's own engine vs `--engine vllm`, same threads, same `--dtype` (float32 unless
  told). No target: the own engine's anchor.

Load (layer, engines): `--requests` slices of the package's English corpus, 300-1,000 tokens each,
sent as token ids (both servers get the very same prompts), 128 output tokens with `ignore_eos`,
streamed, closed loop at concurrency 16. Every side-run gets a fresh server, is health-waited,
warmed with a few short requests (startup and warm-up are not measured), and is stopped (its
process group) after, on error too. The machine is noisy, so sides alternate: A,B per repeat,
every second repeat B first (R=2: A,B,B,A). The vLLM sides need vLLM's venv (`--engine-python`,
default `.venv-vllm/bin/python` in the repo; `make install-vllm` builds it).
JSON (`--json`, schema "tokenmill.bench.engines" v1): {schema, schema_version, config, comparisons:
[{name, workload, error, sides: {name: {command, env, figures pooled over its runs}}, ratio_of,
ratios (first side / second, per figure), targets: [{label, figure, numerator, denominator, op,
bound, value, met}], runs}]}. Exit: 0 every request of every run answered in full, 1 otherwise or a
server failed, 2 a bad flag.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from tokenmill.bench.engines.engines_report import comparison_report, complete, payload, render, run_outcome
from tokenmill.bench.engines.engines_sides import (
    COMPARISONS,
    ENGINES,
    LAYER,
    ROUTING,
    SERVED_NAME,
    Comparison,
    EnginesConfig,
    Side,
    engines,
    layer,
    routing,
    side_server,
)
from tokenmill.bench.harness import loadgen
from tokenmill.bench.harness.text_workload import TextTarget, corpus_words
from tokenmill.workloads.prompt_synth import SyntheticShape

log = logging.getLogger(__name__)

# flag -> (default, default with --quick)
SIZES: dict[str, tuple[int, int]] = {
    "requests": (48, 4), "concurrency": (16, 2), "routing_concurrency": (8, 2), "min_input": (300, 48),
    "max_input": (1000, 96), "max_tokens": (128, 16), "prefix_words": (1000, 48), "groups": (8, 2),
}
DTYPES = ("float32", "bfloat16")  # bfloat16 only pays where the CPU multiplies it natively
_POSITIVE = ("repeats", "max_model_len", "threads", "kvcache_gib", "pool_fraction", "timeout_s",
             "start_timeout_s", *SIZES)


def _repo_root() -> Path:
    """The checkout this package runs from (editable install), else the working directory."""
    root = Path(__file__).resolve().parents[4]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sized = "(default %d; --quick %d)"
    parser.add_argument("--compare", default=",".join(COMPARISONS), help="comma list of " + ", ".join(COMPARISONS))
    parser.add_argument("--model", default=None, help="checkpoint dir (default .models/smollm2-135m-instruct)")
    parser.add_argument("--engine-python", default=None, help="vLLM venv's python (default .venv-vllm/bin/python)")
    parser.add_argument("--requests", type=int, help="measured requests per run " + sized % SIZES["requests"])
    parser.add_argument("--repeats", type=int, default=1, help="runs per side; every second pair runs B first")
    parser.add_argument("--concurrency", type=int, help="layer, engines " + sized % SIZES["concurrency"])
    parser.add_argument("--routing-concurrency", type=int, help="routing " + sized % SIZES["routing_concurrency"])
    parser.add_argument("--min-input", type=int, help="prompt tokens, at least " + sized % SIZES["min_input"])
    parser.add_argument("--max-input", type=int, help="prompt tokens, at most " + sized % SIZES["max_input"])
    parser.add_argument("--max-tokens", type=int, help="output tokens " + sized % SIZES["max_tokens"])
    parser.add_argument("--max-model-len", type=int, default=2048, help="context of layer and engines' servers")
    parser.add_argument("--threads", type=int, default=2, help="cores per engine (vLLM: cores 0..N-1)")
    parser.add_argument("--kvcache-gib", type=int, default=1,
                        help="KV pool per engine: VLLM_CPU_KVCACHE_SPACE, the own engine's --kv-cache-gb")
    parser.add_argument("--prefix-words", type=int, help="routing prefixes " + sized % SIZES["prefix_words"])
    parser.add_argument("--groups", type=int, help="routing prefix groups " + sized % SIZES["groups"])
    parser.add_argument("--pool-fraction", type=float, default=0.6, help="routing: of all prefixes' blocks, per worker")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each request")
    parser.add_argument("--start-timeout-s", type=float, default=300.0, help="until a server is ready")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32",
                        help=f"every side's weights and KV: {' or '.join(DTYPES)} (bfloat16 where the CPU has it "
                             "natively, e.g. AMX)")
    parser.add_argument("--quick", action="store_true", help="a tiny run (a smoke test): few, short requests")
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _sized(args: argparse.Namespace) -> dict[str, int]:
    """The sizes: what was given, else the (quick) default; ValueError naming a non-positive one."""
    sizes = {k: v if (v := getattr(args, k)) is not None else SIZES[k][int(args.quick)] for k in SIZES}
    for name in _POSITIVE:
        value = sizes[name] if name in sizes else getattr(args, name)
        if value <= 0:
            raise ValueError(f"{_flag(name)} must be positive, got {value}")
    return sizes


def _compare(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or set(names) - set(COMPARISONS) or len(set(names)) != len(names):
        raise ValueError(f"--compare must be distinct names from {','.join(COMPARISONS)}, got {text!r}")
    return names


def _engine_python(args: argparse.Namespace) -> Path:
    path = Path(args.engine_python) if args.engine_python else _repo_root() / ".venv-vllm" / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ValueError(f"--engine-python {path}: no such interpreter; run `make install-vllm` to build the vLLM venv")
    return path


def _model_context(model: Path) -> int:
    try:
        config = json.loads((model / "config.json").read_text(encoding="utf-8"))
        return int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--model {model}: no readable config.json with max_position_embeddings ({exc})") from exc


def resolve(args: argparse.Namespace) -> EnginesConfig:
    """The run's settings from the flags; ValueError naming the flag for any mistake."""
    compare, sizes = _compare(args.compare), _sized(args)
    shape = SyntheticShape(sizes["min_input"], sizes["max_input"], sizes["max_tokens"], sizes["max_tokens"])
    if shape.max_input + shape.max_output > args.max_model_len:
        raise ValueError(f"--max-model-len {args.max_model_len} cannot hold {shape.max_input} prompt and "
                         f"{shape.max_output} output tokens")
    if args.threads > (os.cpu_count() or 1):
        raise ValueError(f"--threads {args.threads}: this machine has {os.cpu_count()} cores")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype {args.dtype}: choose {' or '.join(DTYPES)}")
    engine_python = _engine_python(args)
    model = Path(args.model) if args.model else _repo_root() / ".models" / "smollm2-135m-instruct"
    context = _model_context(model)
    if args.max_model_len > context:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's context ({context})")
    return EnginesConfig(
        compare=compare, model=model, engine_python=engine_python, requests=sizes["requests"],
        repeats=args.repeats, concurrency=sizes["concurrency"], routing_concurrency=sizes["routing_concurrency"],
        shape=shape, max_model_len=args.max_model_len, model_context=context, threads=args.threads,
        kvcache_gib=args.kvcache_gib, prefix_words=sizes["prefix_words"], groups=sizes["groups"],
        pool_fraction=args.pool_fraction, timeout_s=args.timeout_s, start_timeout_s=args.start_timeout_s,
        seed=args.seed, dtype=args.dtype)


def build_comparisons(cfg: EnginesConfig) -> list[Comparison]:
    """Every comparison's servers and load, before any server starts (a bad size fails fast)."""
    from tokenmill.textgen.tokenizer import Tokenizer

    tokenizer = Tokenizer(cfg.model)
    corpus = tokenizer.encode(" ".join(corpus_words()), add_special_tokens=False)
    built = {LAYER: lambda: layer(cfg, corpus), ROUTING: lambda: routing(cfg, corpus, tokenizer),
             ENGINES: lambda: engines(cfg, corpus)}
    return [built[name]() for name in cfg.compare]


async def _drive(url: str, comparison: Comparison, timeout_s: float) -> list[loadgen.RequestRecord]:
    """The warm-up requests (all at once, not measured), then the measured closed loop."""
    target = TextTarget(url, SERVED_NAME, timeout_s)
    async with loadgen.make_client(comparison.concurrency + 2) as client:
        warm = loadgen.new_records(comparison.warmup)
        await loadgen.run_closed_loop(client, target, comparison.warmup, warm, len(warm), lambda record: None)
        failed = next((r for r in warm if r.status != loadgen.OK), None)
        if failed is not None:
            raise RuntimeError(f"warm-up request failed: {failed.status} {failed.error}")
        records = loadgen.new_records(comparison.specs)
        await loadgen.run_closed_loop(client, target, comparison.specs, records, comparison.concurrency,
                                      lambda record: None)
    return records


def run_side(comparison: Comparison, side: Side, repeat: int, cfg: EnginesConfig,
             work_dir: Path) -> list[loadgen.RequestRecord]:
    tag = f"{comparison.name}-{side.name}-{repeat}"
    log.info("%s: starting %s", tag, side.command())
    with side_server(side, work_dir, tag, cfg.start_timeout_s) as url:
        records = asyncio.run(_drive(url, comparison, cfg.timeout_s))
    ok = sum(1 for r in records if r.status == loadgen.OK)
    log.info("%s: %d/%d requests ok", tag, ok, len(records))
    return records


def run_comparison(comparison: Comparison, cfg: EnginesConfig, work_dir: Path) -> dict[str, Any]:
    """Sides alternating, A,B then B,A; a server that fails ends the comparison, not the bench."""
    runs, error = [], None
    try:
        for repeat in range(cfg.repeats):
            order = comparison.sides if repeat % 2 == 0 else comparison.sides[::-1]
            for position, side in enumerate(order):
                records = run_side(comparison, side, repeat, cfg, work_dir)
                runs.append(run_outcome(side.name, repeat, position, records))
    except RuntimeError as exc:  # a server that would not start, or a failed warm-up
        error = str(exc)
        log.error("bench engines %s: %s", comparison.name, exc)
    sides = {side.name: side.describe() for side in comparison.sides}
    return comparison_report(comparison.name, sides, runs, comparison.goals, comparison.workload, error)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
    try:
        cfg = resolve(args)
        comparisons = build_comparisons(cfg)
    except ValueError as exc:
        log.error("bench engines: %s", exc)
        return 2
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 160)  # a log file gets each row on one line
    reports = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-engines-") as work:
        for comparison in comparisons:
            reports.append(run_comparison(comparison, cfg, Path(work)))
            render(reports[-1], console)
    if args.json_path:
        config = {**asdict(cfg), "quick": args.quick}
        Path(args.json_path).write_text(json.dumps(payload(config, reports), indent=2, default=str) + "\n",
                                        encoding="utf-8")
        log.info("wrote %s", args.json_path)
    return 0 if all(complete(r) for r in reports) else 1
