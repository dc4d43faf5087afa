"""`tokenmill bench replay`: the same seeded requests through `tokenmill serve` twice, in different
orders, under load: how many come back with the same text (and the same logprobs).

Each side is a fresh `serve` with 2 workers, `--deterministic` or not. The requests (seeded, at
temperature 1, prompts of 16-400 token ids, a third of them sharing a 96-token prefix) are sent
`--concurrency` at a time: first in their drawn order, then shuffled, so that each one shares its
steps with other requests the second time, and finds its prompt cached where the first pass left
it. The table counts the requests whose two passes gave the same text, and those that also gave
the same logprob for every token.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.harness.checkpoint import model_or_small_moe
from tokenmill.bench.harness.report_file import write_json
from tokenmill.bench.harness.serve_process import running_server

log = logging.getLogger(__name__)

SIDES = ("deterministic", "default")
MODEL_NAME = "replay"


@dataclass(slots=True)
class SideResult:
    side: str
    requests: int
    identical_texts: int
    identical_logprobs: int
    first_pass_s: float
    second_pass_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: a fresh small-moe in a temp dir)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sides", default=",".join(SIDES),
                        help="which serve runs: deterministic, default or both (comma-separated)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")


def requests(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 2000) for _ in range(96)]
    bodies = []
    for i in range(count):
        prompt = [rng.randrange(3, 2000) for _ in range(rng.randint(16, 400))]
        if i % 3 == 0:
            prompt = shared + prompt[:300]
        bodies.append({"model": MODEL_NAME, "prompt": prompt, "max_tokens": rng.randint(8, 64), "temperature": 1.0,
                       "seed": 1000 + i, "logprobs": 0, "ignore_eos": True})
    return bodies


async def _pass(url: str, bodies: list[dict[str, Any]], order: list[int], concurrency: int) -> dict[int, tuple]:
    """Every request once, `concurrency` at a time in `order`: index -> (text, token logprobs)."""
    pending = iter(order)
    answers: dict[int, tuple] = {}

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in pending:
            response = await client.post("/v1/completions", json=bodies[i])
            response.raise_for_status()
            choice = response.json()["choices"][0]
            answers[i] = (choice["text"], tuple(choice["logprobs"]["token_logprobs"]))

    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return answers


def run_side(side: str, args: argparse.Namespace, bodies: list[dict[str, Any]], work: Path) -> SideResult:
    flags = ["--model", args.model, "--served-model-name", MODEL_NAME, "--workers", str(args.workers)]
    flags += ["--deterministic"] if side == "deterministic" else []
    flags += ["--threads", str(args.threads)] if args.threads else []
    first_order = list(range(len(bodies)))
    second_order = random.Random(1).sample(first_order, len(first_order))
    with running_server(flags, args.workers, work / side, work / f"{side}.log") as server:
        started = time.perf_counter()
        first = asyncio.run(_pass(server.url, bodies, first_order, args.concurrency))
        middle = time.perf_counter()
        second = asyncio.run(_pass(server.url, bodies, second_order, args.concurrency))
        ended = time.perf_counter()
    texts = sum(first[i][0] == second[i][0] for i in first_order)
    logprobs = sum(first[i] == second[i] for i in first_order)
    log.info("%s: %d/%d identical texts", side, texts, len(bodies))
    return SideResult(side, len(bodies), texts, logprobs, middle - started, ended - middle)


def _print(results: list[SideResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bench replay: seeded requests through serve twice, in different orders")
    for column in ("side", "identical texts", "identical logprobs", "first pass s", "second pass s"):
        table.add_column(column, justify="left" if column == "side" else "right")
    for r in results:
        table.add_row(r.side, f"{r.identical_texts}/{r.requests}", f"{r.identical_logprobs}/{r.requests}",
                      f"{r.first_pass_s:.1f}", f"{r.second_pass_s:.1f}")
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))  # not a line per request
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in SIDES for s in sides):
        log.error("bench replay: --sides %r: each must be one of %s", args.sides, ", ".join(SIDES))
        return 2
    for flag in ("requests", "concurrency", "workers"):
        if getattr(args, flag) < 1:
            log.error("bench replay: --%s must be at least 1, got %d", flag, getattr(args, flag))
            return 2
    model_name = args.model or "small-moe (make-model, seed 0)"
    with tempfile.TemporaryDirectory(prefix="tokenmill-replay-") as tmp:
        work = Path(tmp)
        args.model = model_or_small_moe(args.model, work)
        bodies = requests(args.requests)
        results = [run_side(side, args, bodies, work) for side in sides]
    _print(results)
    if args.json_path:
        config = {"model": model_name, **{k: getattr(args, k) for k in ("requests", "concurrency", "workers")}}
        write_json({"config": config, "sides": [asdict(r) for r in results]}, args.json_path)
    return 0
