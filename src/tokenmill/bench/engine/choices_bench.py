"""`tokenmill bench choices`: one request with n = 4 against 4 separate requests of the same prompt.

A request's n choices share one prefill (api/choices.py); four separate requests sent
together each compute the prompt. Rounds alternate the two ways, each round on a fresh
random prompt (nothing cached from an earlier round), on a real `tokenmill serve` with the
torch runner (small-moe by default). Reported per way: wall seconds per round, output tokens
per second, and the prompt tokens the worker computed (from its `prefill_tokens` counter),
whose ratio is the shared prefill. JSON with `--json OUT` (schema "tokenmill.bench.choices").
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from tokenmill.bench.harness.checkpoint import model_or_small_moe
from tokenmill.bench.harness.serve_process import ServeProcess, running_server

log = logging.getLogger(__name__)

SCHEMA_NAME, SCHEMA_VERSION = "tokenmill.bench.choices", 1
WAYS = ("n=4 in one request", "4 separate requests")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: a fresh small-moe in a temp dir)")
    parser.add_argument("--n", type=int, default=4, help="choices (and separate requests) per round")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each way, alternating")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the worker")
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")


def _prefill_tokens(server: ServeProcess) -> float:
    return sum(float(w["metadata"].get("prefill_tokens", 0)) for w in server.registry())


async def _round(url: str, prompt: list[int], n: int, max_tokens: int, shared: bool) -> float:
    body = {"model": "choices", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0,
            "seed": 1}
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        started = time.perf_counter()
        bodies = [{**body, "n": n}] if shared else [{**body, "seed": j} for j in range(n)]
        responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        wall = time.perf_counter() - started
    for response in responses:
        response.raise_for_status()
    produced = sum(r.json()["usage"]["completion_tokens"] for r in responses)
    if produced != n * max_tokens:
        raise RuntimeError(f"expected {n * max_tokens} output tokens, got {produced}")
    return wall


def _measure(server: ServeProcess, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    rng = random.Random(0)
    results: dict[str, dict[str, list[float]]] = {way: {"wall_s": [], "prefill_tokens": []} for way in WAYS}
    for round_index in range(args.rounds):
        for way in WAYS:
            prompt = [rng.randint(3, 2000) for _ in range(args.prompt_tokens)]  # fresh: nothing cached
            before = _prefill_tokens(server)
            wall = asyncio.run(_round(server.url, prompt, args.n, args.max_tokens, shared=way == WAYS[0]))
            time.sleep(0.7)  # one heartbeat carries the worker's counter into the registry
            results[way]["wall_s"].append(wall)
            results[way]["prefill_tokens"].append(_prefill_tokens(server) - before)
            log.info("round %d, %s: %.2f s", round_index, way, wall)
    return results


def _report(results: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> dict[str, Any]:
    ways = {}
    for way, figures in results.items():
        wall = statistics.median(figures["wall_s"])
        ways[way] = {"median_wall_s": wall, "output_tokens_per_s": args.n * args.max_tokens / wall,
                     "median_prefill_tokens": statistics.median(figures["prefill_tokens"]), **figures}
    shared, separate = (ways[w] for w in WAYS)
    return {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
            "config": {k: getattr(args, k) for k in ("model", "n", "prompt_tokens", "max_tokens", "rounds")},
            "ways": ways, "throughput_ratio": shared["output_tokens_per_s"] / separate["output_tokens_per_s"],
            "prefill_ratio": separate["median_prefill_tokens"] / max(1.0, shared["median_prefill_tokens"])}


def _print(report: dict[str, Any]) -> None:
    table = Table(title=f"bench choices: {report['config']['n']} choices of a {report['config']['prompt_tokens']}-"
                        f"token prompt, {report['config']['max_tokens']} tokens each")
    for column in ("way", "median wall s", "output tok/s", "prompt tokens computed"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for way, figures in report["ways"].items():
        table.add_row(way, f"{figures['median_wall_s']:.2f}", f"{figures['output_tokens_per_s']:.1f}",
                      f"{figures['median_prefill_tokens']:.0f}")
    console = Console()
    console.print(table)
    console.print(f"n=4 / separate: {report['throughput_ratio']:.2f}x output tok/s, "
                  f"{report['prefill_ratio']:.2f}x fewer prompt tokens computed")


def run(args: argparse.Namespace) -> int:
    if args.n < 2 or args.rounds < 1 or args.prompt_tokens < 16 or args.max_tokens < 1:
        print("error: --n >= 2, --rounds >= 1, --prompt-tokens >= 16, --max-tokens >= 1")
        return 2
    with tempfile.TemporaryDirectory(prefix="tokenmill-choices-") as tmp:
        work = Path(tmp)
        args.model = model_or_small_moe(args.model, work)
        flags = ["--model", args.model, "--served-model-name", "choices", "--router", "kv"]
        flags += ["--threads", str(args.threads)] if args.threads else []
        with running_server(flags, 1, work / "run", work / "serve.log") as server:
            results = _measure(server, args)
    report = _report(results, args)
    _print(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0
