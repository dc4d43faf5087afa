"""`tokenmill bench router-warmup`: how soon a freshly started frontend routes by KV overlap over
workers that already hold many cached blocks, with and without the snapshot it asks each
worker for as it joins.

The fleet: one `tokenmill serve --runner mock --mock-step-time 0,0,0,0 --router kv --workers W`
whose workers are filled, over their request plane, with distinct token-id prompts of
`--prompt-tokens` until together they hold `--blocks` cached blocks (router_warmup_fleet.py).
The fill is verified: the workers' own KV snapshots hold every block sent, each prompt's prefix
on its worker alone, and the serve frontend's index (built from KV events) holds as many.

Then, per mode and repeat, a fresh `tokenmill frontend --router kv` is started on the same
discovery and timed from just before its Popen (router_warmup_probe.py):
- `snapshot`: the default; the frontend asks each worker for its snapshot as it joins;
- `cold`: `--no-kv-snapshot-on-join`; the index starts empty and a worker's blocks arrive only
  with its first KV event after the join (the event-id gap asks for its snapshot), i.e. once
  traffic that stores new blocks has been routed to it (a pure cache hit publishes no event):
  this mode measures what traffic alone gives.
Figures, in seconds from the process start: `http_up_s` (/metrics answers), `workers_joined_s`
(every worker connected), `index_99_s` (`tokenmill_router_index_blocks` >= 99% of the blocks the
workers' snapshots held just before), `first_kv_probe_s` (the response to the first KV-aware
probe: routing decision overlap > 0 and served by the prefix's holder with the whole prefix
cached); also the probes before it, the first probe's latency (it waits while snapshots are
applied on the frontend's event loop), and the fraction of KV-aware probes in the first
`--probe-window-s` of probing. Probes start once every worker is connected, one at a time.

JSON (`--json OUT`, schema "tokenmill.bench.router_warmup" v1): {schema, schema_version, config
{every flag}, fleet {workers, prompt_tokens, prompts_per_worker, kv_cache_blocks, worker_blocks
{id: n}, truth_blocks, first_frontend_index_blocks, misplaced_prefixes, fill_verified, fill_s,
fill_blocks_per_s}, runs [WarmupRun's fields], summary {mode: {runs, complete, medians, kv_fraction}}}.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.harness.serve_process import HOST, ServeProcess, free_port, running_server
from tokenmill.bench.routing import router_warmup_fleet as fleet_mod
from tokenmill.bench.routing import router_warmup_probe as probe_mod
from tokenmill.bench.routing.router_warmup_report import render, summarize

log = logging.getLogger(__name__)

SCHEMA_NAME, SCHEMA_VERSION = "tokenmill.bench.router_warmup", 1
SERVED_NAME = "router-warmup"
MODES = {"snapshot": [], "cold": ["--no-kv-snapshot-on-join"]}
INDEX_SETTLE_S = 60.0  # the serve frontend applying the fill's last KV events


@dataclass(slots=True)
class Fleet:
    plan: fleet_mod.FillPlan
    server: ServeProcess
    links: list[fleet_mod.WorkerLink]
    model: Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: tiny-llama in a temp dir)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="cached blocks over all workers")
    parser.add_argument("--prompt-tokens", type=int, default=2032, help="per fill prompt (a multiple of 16)")
    parser.add_argument("--prefix-blocks", type=int, default=8, help="cached blocks at the head of each probe")
    parser.add_argument("--modes", default="snapshot,cold", help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=3, help="fresh frontends per mode, modes alternating")
    parser.add_argument("--probe-window-s", type=float, default=5.0, help="probing counted in the KV fraction")
    parser.add_argument("--probe-interval-s", type=float, default=0.1)
    parser.add_argument("--poll-s", type=float, default=0.02, help="/metrics poll while no probe is due")
    parser.add_argument("--run-timeout-s", type=float, default=60.0, help="per measured frontend")
    parser.add_argument("--fill-in-flight", type=int, default=8, help="fill requests in flight per worker")
    parser.add_argument("--start-timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")


def _validate(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES) or len(set(modes)) != len(modes):
        raise ValueError(f"--modes must be distinct names from {', '.join(MODES)}, got {args.modes!r}")
    for name in ("workers", "blocks", "prompt_tokens", "prefix_blocks", "repeats", "probe_window_s",
                 "probe_interval_s", "poll_s", "run_timeout_s", "fill_in_flight", "start_timeout_s"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.prompt_tokens % fleet_mod.BLOCK_SIZE:
        raise ValueError(f"--prompt-tokens must be a multiple of {fleet_mod.BLOCK_SIZE}")
    if args.prefix_blocks * fleet_mod.BLOCK_SIZE > args.prompt_tokens:
        raise ValueError("--prefix-blocks must fit in --prompt-tokens")
    return modes


def prepare_model(args: argparse.Namespace, work: Path) -> tuple[Path, int]:
    """The checkpoint (a context that fits the prompts) and its vocabulary size."""
    from tokenmill.bench.harness.checkpoint import fit_context
    from tokenmill.engine.make_model import write_model

    owned = args.model is None
    model = write_model("tiny-llama", work / "tiny-llama", seed=0) if owned else Path(args.model)
    fit_context(model, args.prompt_tokens + fleet_mod.BLOCK_SIZE, owned)
    return model, int(json.loads((model / "config.json").read_text(encoding="utf-8"))["vocab_size"])


def kv_cache_blocks(plan: fleet_mod.FillPlan, args: argparse.Namespace) -> int:
    """The fill plus room for every block the probes could add, were they all on one worker:
    an eviction could drop a fill prefix a later probe counts on."""
    probes = min(plan.workers * plan.prompts_per_worker,
                 args.repeats * len(MODES) * int(args.run_timeout_s / args.probe_interval_s + 1))
    per_probe = args.prefix_blocks + -(-probe_mod.TAIL_TOKENS // fleet_mod.BLOCK_SIZE)
    return plan.blocks_per_worker + probes * per_probe


def serve_flags(model: Path, plan: fleet_mod.FillPlan, args: argparse.Namespace) -> list[str]:
    return ["--model", str(model), "--runner", "mock", "--mock-step-time", "0,0,0,0", "--router", "kv",
            "--kv-cache-blocks", str(kv_cache_blocks(plan, args)), "--block-size", str(fleet_mod.BLOCK_SIZE),
            "--max-num-batched-tokens", str(4 * plan.prompt_tokens), "--served-model-name", SERVED_NAME,
            "--no-access-log", "--seed", str(args.seed)]


def _index_blocks(url: str, at_least: int) -> int:
    """The serve frontend's index once it holds `at_least` blocks, or what it holds after INDEX_SETTLE_S."""
    deadline, seen = time.monotonic() + INDEX_SETTLE_S, None
    with httpx.Client(trust_env=False, timeout=probe_mod.HTTP_TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            seen = probe_mod.scrape(client, url) or seen
            if seen is not None and seen.index_blocks >= at_least:
                break
            time.sleep(0.2)
    return int(seen.index_blocks) if seen is not None else 0


def fill_and_verify(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    plan = fleet.plan
    started = time.monotonic()
    fleet_mod.fill(fleet.links, plan, args.fill_in_flight)
    fill_s = time.monotonic() - started
    held = fleet_mod.snapshots(fleet.links)
    ids = [link.worker_id for link in fleet.links]
    hash_seed = int(fleet.server.registry()[0].get("metadata", {}).get("hash_seed") or 0)
    misplaced = fleet_mod.misplaced_prefixes(plan, held, ids, args.prefix_blocks, hash_seed)
    worker_blocks = {w: len(hashes) for w, hashes in held.items()}
    truth = sum(worker_blocks.values())
    del held
    indexed = _index_blocks(fleet.server.url, truth)
    sent = plan.workers * plan.blocks_per_worker
    verified = truth == sent and indexed == truth and misplaced == 0
    if not verified:
        log.error("fill not as planned: %d blocks sent, workers hold %d, serve's index %d, %d prefixes misplaced",
                  sent, truth, indexed, misplaced)
    return {"workers": plan.workers, "prompt_tokens": plan.prompt_tokens,
            "prompts_per_worker": plan.prompts_per_worker, "kv_cache_blocks": kv_cache_blocks(plan, args),
            "worker_blocks": worker_blocks, "truth_blocks": truth, "first_frontend_index_blocks": indexed,
            "misplaced_prefixes": misplaced, "fill_verified": verified, "fill_s": fill_s,
            "fill_blocks_per_s": sent / fill_s if fill_s > 0 else None}


def frontend_argv(fleet: Fleet, port: int, mode: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "--log-level", "INFO", "frontend", "--model", str(fleet.model),
            "--discovery", f"file:{fleet.server.run_dir / 'registry'}", "--router", "kv", "--host", HOST,
            "--port", str(port), "--served-model-name", SERVED_NAME, "--block-size", str(fleet_mod.BLOCK_SIZE),
            "--no-access-log", "--parent-pid", str(os.getpid()), *MODES[mode]]


def measure(fleet: Fleet, mode: str, repeat: int, source: probe_mod.ProbeSource, args: argparse.Namespace,
            work: Path) -> probe_mod.WarmupRun:
    truth = sum(len(h) for h in fleet_mod.snapshots(fleet.links).values())
    port = free_port()
    settings = probe_mod.ProbeSettings(f"http://{HOST}:{port}", SERVED_NAME, fleet.plan.workers, args.prefix_blocks,
                                       args.probe_window_s, args.probe_interval_s, args.poll_s, args.run_timeout_s)
    log.info("router-warmup: %s run %d over %d cached blocks", mode, repeat, truth)
    process, t0 = probe_mod.start_frontend(frontend_argv(fleet, port, mode), work / f"frontend-{mode}-{repeat}.log")
    try:
        return probe_mod.observe(process, t0, settings, source, probe_mod.WarmupRun(mode, repeat, truth))
    finally:
        probe_mod.stop_frontend(process)


def bench(args: argparse.Namespace, modes: list[str], work: Path) -> dict[str, Any]:
    model, vocab = prepare_model(args, work)
    plan = fleet_mod.FillPlan.for_blocks(args.blocks, args.workers, args.prompt_tokens, vocab, args.seed)
    log.info("router-warmup: %d workers x %d prompts of %d tokens", plan.workers, plan.prompts_per_worker,
             plan.prompt_tokens)
    with running_server(serve_flags(model, plan, args), args.workers, work / "run", work / "serve.log",
                        args.start_timeout_s) as server, fleet_mod.links(server.registry()) as links:
        fleet = Fleet(plan, server, links, model)
        fleet_report = fill_and_verify(fleet, args)
        source = probe_mod.ProbeSource(plan, args.prefix_blocks)
        runs = [measure(fleet, mode, repeat, source, args, work) for repeat in range(args.repeats) for mode in modes]
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
    return {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, "config": config, "fleet": fleet_report,
            "runs": [asdict(r) for r in runs], "summary": summarize(runs)}


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `finally`s that stop every process


def run(args: argparse.Namespace) -> int:
    """0 when the fill was verified and every run saw both its index warm and a KV-aware probe;
    1 otherwise (or on a failure to start), 2 for bad flags."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
    try:
        modes = _validate(args)
    except ValueError as exc:
        log.error("bench router-warmup: %s", exc)
        return 2
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if main_thread else None
    try:
        # a short prefix: the workers' ipc socket paths under it must stay within 107 bytes
        with tempfile.TemporaryDirectory(prefix="tokenmill-warmup-") as work:
            report = bench(args, modes, Path(work))
    except (RuntimeError, ValueError) as exc:
        log.error("bench router-warmup: %s", exc)
        return 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    render(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log.info("wrote %s", args.json_path)
    complete = all(s["complete"] == s["runs"] for s in report["summary"].values())
    return 0 if report["fleet"]["fill_verified"] and complete else 1
