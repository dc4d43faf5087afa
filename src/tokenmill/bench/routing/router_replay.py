"""`tokenmill bench router-replay`: one Mooncake trace through `tokenmill serve` under each routing policy.

For every policy a fresh `tokenmill serve --workers N --runner mock --router POLICY` is started,
the same requests (built once from the trace) are replayed open-loop at the trace's scaled
arrival times, and the server is stopped. Per policy: mean/p50/p99 TTFT, prefill tokens
computed (prompt − cached tokens, from usage), cache hit rate, output tokens/s, requests per
worker; and mean TTFT(round-robin) ÷ mean TTFT(kv) (the target: ≥ 2).

Default scaling, and why:
- the whole trace from its first record: its prefix reuse grows from ~5% of blocks in the first
  250 records to ~95% in the last, so a head slice would hide what routing can gain
  (`--max-requests N` keeps the first N, never a chosen slice);
- 16 tokens per trace hash block: one KV block per hash id; `--time-scale 0.15`: the 1,022 s
  trace in ~153 s (~26 requests/s: CPU headroom for frontend, load generator and workers on 2 cores);
- 4,096 KV blocks per worker: the 4 workers hold ~37% of the trace's ~44 k distinct blocks;
- mock step `0.002,0.00025,0.0002,1e-7`: a 500-token prefill costs as much as ~60 one-sequence
  decode steps; round-robin's busiest stretch then needs ~90% of the fleet, kv's far less;
- outputs capped at 32 tokens (TTFT is the metric; 149-token outputs at this rate would be more
  streaming than 2 cores sustain), prompts at the model context minus that.

JSON (`--json OUT`, schema "tokenmill.bench.routing.router_replay", version 1): {schema, schema_version,
config {every flag}, workload {num_requests, prompt_tokens, output_tokens, arrival_span_s,
reusable_fraction (what one infinite cache could reuse: the ceiling for any hit rate)}, policies
{POLICY: PolicyResult's fields; worker_requests includes the one warm-up request},
ttft_ratio_round_robin_over_kv (null unless both ran), target_met (ratio ≥ 2, or null)}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.bench.harness import loadgen
from tokenmill.bench.harness.checkpoint import model_limits
from tokenmill.bench.harness.serve_process import ServeProcess, running_server
from tokenmill.bench.harness.serve_stats import SLO, summarize
from tokenmill.bench.harness.trace_replay import TraceFit, read_trace, trace_requests
from tokenmill.datasets import MOONCAKE_TRACE, data_dir
from tokenmill.workloads.prompt_synth import HashBlockSynth, RequestSpec, TokenSpace

log = logging.getLogger(__name__)

SCHEMA_NAME, SCHEMA_VERSION = "tokenmill.bench.routing.router_replay", 1
POLICIES = ("kv", "kv-approx", "round-robin", "random", "least-loaded")
DEFAULT_STEP_TIME = "0.002,0.00025,0.0002,0.0000001"
TARGET_RATIO = 2.0
SERVED_NAME = "router-replay"
REGISTRY_SETTLE_S = 5.0  # the workers' heartbeats (every 0.5 s) carry their final request counts


@dataclass(slots=True)
class PolicyResult:
    requests_total: int
    requests_ok: int
    outcomes: dict[str, int]
    duration_s: float
    ttft_ms_mean: float | None
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens_computed: int
    cache_hit_rate: float
    output_tokens: int
    output_token_throughput: float
    worker_requests: list[int]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint dir (only config + tokenizer are read)")
    parser.add_argument("--trace", default=str(data_dir() / MOONCAKE_TRACE),
                        help="Mooncake-format JSONL trace (default: the shipped Mooncake trace)")
    parser.add_argument("--policies", default="kv,round-robin,random", help=f"comma list of {', '.join(POLICIES)}")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")
    parser.add_argument("--seed", type=int, default=0)
    scale = parser.add_argument_group("scaling (see the module docstring for the defaults' reasons)")
    scale.add_argument("--tokens-per-hash-block", type=int, default=16, help="tokens per trace hash id")
    scale.add_argument("--time-scale", type=float, default=0.15, help="multiplies inter-arrival times")
    scale.add_argument("--max-requests", type=int, default=None, help="the first N records (default: all)")
    scale.add_argument("--max-input-tokens", type=int, default=None, help="default: context − output cap")
    scale.add_argument("--max-output-tokens", type=int, default=32)
    server = parser.add_argument_group("servers (passed to tokenmill serve)")
    server.add_argument("--mock-step-time", default=DEFAULT_STEP_TIME, metavar="A,B,C,D")
    server.add_argument("--kv-cache-blocks", type=int, default=4096, help="per worker")
    server.add_argument("--max-num-batched-tokens", type=int, default=512)
    server.add_argument("--max-num-seqs", type=int, default=64)
    server.add_argument("--timeout-s", type=float, default=300.0, help="deadline of each request")
    server.add_argument("--start-timeout-s", type=float, default=120.0, help="wait for a server's health")


def _policies(args: argparse.Namespace) -> list[str]:
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"--policies must be distinct names from {', '.join(POLICIES)}, got {args.policies!r}")
    return names


def _validate(args: argparse.Namespace) -> list[str]:
    policies = _policies(args)
    for name in ("workers", "kv_cache_blocks", "max_num_batched_tokens", "max_num_seqs", "timeout_s",
                 "start_timeout_s", "max_output_tokens"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not Path(args.trace).is_file():
        raise ValueError(f"--trace {args.trace}: no such file")
    try:
        steps = [float(x) for x in args.mock_step_time.split(",")]
    except ValueError:
        steps = []
    if len(steps) != 4 or min(steps) < 0:
        raise ValueError(f"--mock-step-time must be four numbers A,B,C,D >= 0, got {args.mock_step_time!r}")
    context, _ = model_limits(args.model)
    if args.max_input_tokens is None:
        args.max_input_tokens = context - args.max_output_tokens
    if args.max_input_tokens <= 0 or args.max_input_tokens + args.max_output_tokens > context:
        raise ValueError(f"--max-input-tokens + --max-output-tokens must fit the model's context of {context}")
    return policies


def build_specs(args: argparse.Namespace) -> list[RequestSpec]:
    """The trace's first --max-requests records as requests; built once, replayed under every policy."""
    _, vocab = model_limits(args.model)
    fit = TraceFit(args.time_scale, args.max_requests, args.max_input_tokens, args.max_output_tokens)
    synth = HashBlockSynth(TokenSpace(vocab), args.tokens_per_hash_block, args.seed)
    return trace_requests(read_trace(args.trace, args.max_requests), synth, fit)


def reusable_fraction(specs: list[RequestSpec], tokens_per_hash_block: int) -> float:
    """Prompt tokens in leading hash blocks seen before: the hit rate of one infinite cache."""
    seen: set[int] = set()
    reusable = 0
    for spec in specs:
        leading = 0
        for hash_id in spec.hash_ids:
            if hash_id not in seen:
                break
            leading += 1
        reusable += min(leading * tokens_per_hash_block, len(spec.prompt))
        seen.update(spec.hash_ids)
    return reusable / max(1, sum(len(s.prompt) for s in specs))


async def _replay(url: str, specs: list[RequestSpec], args: argparse.Namespace) -> list[loadgen.RequestRecord]:
    target = loadgen.Target(url, SERVED_NAME, args.timeout_s)
    async with loadgen.make_client(None) as client:
        warm = loadgen.RequestRecord(-1, 8, 2)  # 8 tokens: below one KV block, so it never caches
        await loadgen.send_one(client, target, RequestSpec(list(range(3, 11)), 2), warm, 0.0)
        if warm.status != loadgen.OK:
            raise RuntimeError(f"warm-up request failed: {warm.status} {warm.error}")
        records = loadgen.new_records(specs)
        await loadgen.run_open_loop(client, target, specs, records, lambda record: None)
    return records


def _worker_requests(server: ServeProcess, expected: int) -> list[int]:
    deadline = time.monotonic() + REGISTRY_SETTLE_S
    while True:
        served = [int(e.get("metadata", {}).get("requests_served", 0)) for e in server.registry()]
        if sum(served) >= expected or time.monotonic() > deadline:
            return served
        time.sleep(0.25)


def _serve_flags(args: argparse.Namespace, policy: str) -> list[str]:
    return ["--model", args.model, "--runner", "mock", "--mock-step-time", args.mock_step_time,
            "--router", policy, "--kv-cache-blocks", str(args.kv_cache_blocks),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
            "--served-model-name", SERVED_NAME, "--seed", str(args.seed)]


def run_policy(policy: str, specs: list[RequestSpec], args: argparse.Namespace, work_dir: Path) -> PolicyResult:
    """Start a server routed by `policy`, replay `specs` through it, stop it."""
    log.info("router-replay: %s, %d workers, %d requests", policy, args.workers, len(specs))
    with running_server(_serve_flags(args, policy), args.workers, work_dir / f"run-{policy}",
                        work_dir / f"serve-{policy}.log", args.start_timeout_s) as server:
        records = asyncio.run(_replay(server.url, specs, args))
        workers = _worker_requests(server, len(records) + 1)
    s = summarize(records, SLO(None, None), None)
    ttft = s.ttft_ms
    return PolicyResult(s.requests_total, s.requests_ok, s.outcomes, s.duration_s,
                        ttft.mean if ttft else None, ttft.p50 if ttft else None, ttft.p99 if ttft else None,
                        s.prompt_tokens, s.cached_tokens, s.prompt_tokens - s.cached_tokens, s.cached_fraction,
                        s.output_tokens, s.output_token_throughput, workers)


def ttft_ratio(results: dict[str, PolicyResult]) -> float | None:
    """Mean TTFT under round-robin ÷ under kv; None unless both ran with TTFTs."""
    kv, rr = results.get("kv"), results.get("round-robin")
    if not kv or not rr or not kv.ttft_ms_mean or rr.ttft_ms_mean is None:
        return None
    return rr.ttft_ms_mean / kv.ttft_ms_mean


def report_json(args: argparse.Namespace, specs: list[RequestSpec], results: dict[str, PolicyResult]) -> dict[str, Any]:
    ratio = ttft_ratio(results)
    workload = {"num_requests": len(specs), "prompt_tokens": sum(len(s.prompt) for s in specs),
                "output_tokens": sum(s.output_len for s in specs),
                "arrival_span_s": max((s.arrival_s or 0.0) for s in specs),
                "reusable_fraction": reusable_fraction(specs, args.tokens_per_hash_block)}
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
    return {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, "config": config, "workload": workload,
            "policies": {name: asdict(result) for name, result in results.items()},
            "ttft_ratio_round_robin_over_kv": ratio, "target_met": None if ratio is None else ratio >= TARGET_RATIO}


def render_table(report: dict[str, Any], console: Console) -> None:
    workload = report["workload"]
    table = Table(title=f"router-replay: {workload['num_requests']} requests, "
                        f"reusable fraction {workload['reusable_fraction']:.3f}")
    for column in ("policy", "ok", "TTFT mean ms", "TTFT p99 ms", "prefill computed", "hit rate", "out tok/s",
                   "busiest worker / mean"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, r in report["policies"].items():
        mean, p99 = (f"{v:.1f}" if v is not None else "-" for v in (r["ttft_ms_mean"], r["ttft_ms_p99"]))
        served = r["worker_requests"] or [0]
        balance = max(served) * len(served) / max(1, sum(served))
        table.add_row(name, f"{r['requests_ok']}/{r['requests_total']}", mean, p99,
                      f"{r['prefill_tokens_computed']:,}", f"{r['cache_hit_rate']:.3f}",
                      f"{r['output_token_throughput']:.1f}", f"{balance:.2f}")
    console.print(table)
    ratio = report["ttft_ratio_round_robin_over_kv"]
    if ratio is not None:
        verdict = "meets" if report["target_met"] else "misses"
        console.print(f"mean TTFT round-robin / kv = {ratio:.2f}x ({verdict} the >= {TARGET_RATIO:g}x target)")


def run(args: argparse.Namespace) -> int:
    """0 when every request under every policy completed, 1 otherwise (or no server), 2 for bad flags."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
    try:
        policies = _validate(args)
        specs = build_specs(args)
    except ValueError as exc:
        log.error("bench router-replay: %s", exc)
        return 2
    results: dict[str, PolicyResult] = {}
    with tempfile.TemporaryDirectory(prefix="tokenmill-router-replay-") as work:
        try:
            for policy in policies:
                results[policy] = run_policy(policy, specs, args, Path(work))
        except RuntimeError as exc:  # a server that would not start, or a failed warm-up
            log.error("bench router-replay: %s", exc)
            return 1
    report = report_json(args, specs, results)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # a log file gets the whole table on one line per policy
    render_table(report, console)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log.info("wrote %s", args.json_path)
    return 0 if all(r.requests_ok == r.requests_total for r in results.values()) else 1
