"""`tokenmill bench prefix-routing`: KV routing against round-robin on a shared-prefix load.

Per `--prefix-words N`: 8 groups, each with its own N-word passage of the package's English corpus
(the Austen novel the test tokenizers are trained on) as shared prefix; 128 requests, each its
group's prefix plus a short unique question, groups in a seeded shuffled order, sent as text (the
server tokenizes), closed loop at concurrency 8, 16 tokens with `ignore_eos`, streamed (TTFT = the
first token). Every (policy, repeat) gets a fresh `tokenmill serve --runner mock --workers 4
--router POLICY`, policies alternating (kv, rr, kv, rr, ...) so a noisy spell hits both.

Defaults follow the issue: step `0.0165,0.000016,0,0` (16.5 ms + 16 µs per prefill token); each
worker's pool holds `--pool-fraction` 0.3 of the 8 prefixes' blocks, so only routing that keeps a
group on a worker realises its hits; `--max-num-batched-tokens` defaults to the longest prompt
(rounded up to 512) so a prefill is one step, as that step model has it. The default checkpoint is
tiny-llama in a temp dir, its context raised to fit: the mock runner never reads the weights.
Targets: mean TTFT rr/kv >= 1.3 at 1,000 words, >= 1.6 at 4,000; p99 TTFT kv/rr <= 1.1.
JSON (`--json`, schema "tokenmill.bench.prefix_routing" v1): {schema, schema_version, config,
sizes: [{prefix_words, prefix_tokens_mean, kv_cache_blocks, max_num_batched_tokens, runs,
policies (pooled over repeats), mean/p99 ratios, targets and whether met}]}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.bench.harness import loadgen
from tokenmill.bench.harness.checkpoint import fit_context
from tokenmill.bench.harness.serve_process import ServeProcess, running_server
from tokenmill.bench.harness.serve_stats import Distribution, distribution_ms
from tokenmill.bench.harness.text_workload import TextSpec, TextTarget, Workload, build_workload, corpus_words
from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE

log = logging.getLogger(__name__)

SCHEMA_NAME, SCHEMA_VERSION = "tokenmill.bench.prefix_routing", 1
MEAN_TARGETS = {1000: 1.3, 4000: 1.6}  # prefix words -> wanted mean TTFT round-robin / kv
P99_TARGET = 1.1  # wanted p99 TTFT kv / round-robin, at most
SERVED_NAME = "prefix-routing"
SETTLE_S = 5.0  # worker heartbeats (every 0.5 s) carry request counts into the registry


@dataclass(slots=True)
class RunResult:
    policy: str
    repeat: int
    requests_ok: int
    requests_total: int
    outcomes: dict[str, int]
    ttft: Distribution | None  # ms
    prompt_tokens: int
    cached_tokens: int
    worker_requests: dict[str, int]
    ttft_ms: list[float] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: tiny-llama in a temp dir)")
    parser.add_argument("--prefix-words", default="1000,4000", help="comma list of shared-prefix sizes in words")
    parser.add_argument("--policies", default="kv,round-robin", help="comma list of routing policies")
    parser.add_argument("--repeats", type=int, default=1, help="runs per policy, alternating policies")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--pool-fraction", type=float, default=0.3, help="of all prefixes' blocks, per worker")
    parser.add_argument("--mock-step-time", default="0.0165,0.000016,0,0", metavar="A,B,C,D")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the longest prompt")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each request")
    parser.add_argument("--start-timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")


def _validate(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    from tokenmill.router.policies import POLICIES

    try:
        sizes = [int(w) for w in args.prefix_words.split(",") if w.strip()]
    except ValueError:
        sizes = []
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"--prefix-words must be positive integers, got {args.prefix_words!r}")
    if not policies or set(policies) - set(POLICIES) or len(set(policies)) != len(policies):
        raise ValueError(f"--policies must be distinct names from {', '.join(POLICIES)}, got {args.policies!r}")
    for name in ("repeats", "groups", "requests", "concurrency", "max_tokens", "workers", "pool_fraction"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return sizes, policies


def prepare_model(args: argparse.Namespace, work_dir: Path) -> Path:
    if args.model is not None:
        return Path(args.model)
    from tokenmill.engine.make_model import write_model

    return write_model("tiny-llama", work_dir / "tiny-llama", seed=0)


def _serve_flags(args: argparse.Namespace, model: Path, policy: str, workload: Workload, batched: int) -> list[str]:
    return ["--model", str(model), "--runner", "mock", "--mock-step-time", args.mock_step_time,
            "--router", policy, "--kv-cache-blocks", str(workload.kv_cache_blocks),
            "--block-size", str(DEFAULT_BLOCK_SIZE), "--max-num-batched-tokens", str(batched),
            "--served-model-name", SERVED_NAME, "--seed", str(args.seed)]


def _served(server: ServeProcess, at_least: int) -> dict[str, int]:
    """Requests served per worker, once the registry counts `at_least` in all (or SETTLE_S passed)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        served = {e["worker_id"]: int(e.get("metadata", {}).get("requests_served", 0)) for e in server.registry()}
        if sum(served.values()) >= at_least or time.monotonic() > deadline:
            return dict(sorted(served.items()))
        time.sleep(0.25)


async def _drive(url: str, specs: list[TextSpec], args: argparse.Namespace,
                 server: ServeProcess) -> tuple[list[loadgen.RequestRecord], dict[str, int]]:
    target = TextTarget(url, SERVED_NAME, args.timeout_s)
    async with loadgen.make_client(args.concurrency + 2) as client:
        # a prompt below one KV block: it warms the path and caches nothing
        warm = loadgen.RequestRecord(-1, 2, 2)
        await loadgen.send_one(client, target, TextSpec([], 2, text="Good morning"), warm, 0.0)
        if warm.status != loadgen.OK:
            raise RuntimeError(f"warm-up request failed: {warm.status} {warm.error}")
        baseline = await asyncio.to_thread(_served, server, 1)
        records = loadgen.new_records(specs)
        await loadgen.run_closed_loop(client, target, specs, records, args.concurrency, lambda record: None)
    return records, baseline


def run_once(policy: str, repeat: int, workload: Workload, args: argparse.Namespace, model: Path,
             batched: int, work_dir: Path) -> RunResult:
    name = f"{workload.prefix_words}w-{policy}-{repeat}"
    with running_server(_serve_flags(args, model, policy, workload, batched), args.workers,
                        work_dir / f"run-{name}", work_dir / f"serve-{name}.log", args.start_timeout_s) as server:
        records, baseline = asyncio.run(_drive(server.url, workload.specs, args, server))
        served = _served(server, sum(baseline.values()) + len(records))
    ok = [r for r in records if r.status == loadgen.OK]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    mismatched = sum(1 for r in ok if r.prompt_tokens != r.prompt_len)
    if mismatched:
        log.warning("%s: %d prompts tokenized to another length by the server than here", name, mismatched)
    return RunResult(policy, repeat, len(ok), len(records), dict(Counter(r.status for r in records)),
                     distribution_ms(ttft),
                     sum(r.prompt_tokens or 0 for r in ok), sum(r.cached_tokens or 0 for r in ok),
                     {w: n - baseline.get(w, 0) for w, n in served.items()}, [t * 1e3 for t in ttft])


def pooled(runs: list[RunResult]) -> dict[str, Any]:
    """One policy's runs together: TTFTs pooled, tokens summed, per-worker counts per run."""
    d = distribution_ms([t / 1e3 for r in runs for t in r.ttft_ms])
    prompt = sum(r.prompt_tokens for r in runs)
    return {"runs": len(runs), "requests_ok": sum(r.requests_ok for r in runs),
            "requests_total": sum(r.requests_total for r in runs),
            **{f"ttft_ms_{k}": getattr(d, k) if d else None for k in ("mean", "p50", "p90", "p99")},
            "cached_fraction": sum(r.cached_tokens for r in runs) / prompt if prompt else 0.0,
            "worker_requests": [list(r.worker_requests.values()) for r in runs]}


def size_report(workload: Workload, batched: int, runs: list[RunResult]) -> dict[str, Any]:
    policies = {p: pooled([r for r in runs if r.policy == p]) for p in dict.fromkeys(r.policy for r in runs)}
    kv, rr = policies.get("kv"), policies.get("round-robin")
    mean_ratio = p99_ratio = None
    if kv and rr and kv["ttft_ms_mean"] and rr["ttft_ms_mean"] and kv["ttft_ms_p99"] and rr["ttft_ms_p99"]:
        mean_ratio, p99_ratio = rr["ttft_ms_mean"] / kv["ttft_ms_mean"], kv["ttft_ms_p99"] / rr["ttft_ms_p99"]
    mean_target = MEAN_TARGETS.get(workload.prefix_words)
    return {"prefix_words": workload.prefix_words,
            "prefix_tokens_mean": sum(workload.prefix_tokens) / len(workload.prefix_tokens),
            "kv_cache_blocks": workload.kv_cache_blocks, "max_num_batched_tokens": batched,
            "runs": [asdict(r) for r in runs], "policies": policies,
            "mean_ratio_rr_over_kv": mean_ratio, "mean_target": mean_target,
            "mean_target_met": None if mean_ratio is None or mean_target is None else mean_ratio >= mean_target,
            "p99_ratio_kv_over_rr": p99_ratio, "p99_target": P99_TARGET,
            "p99_target_met": None if p99_ratio is None else p99_ratio <= P99_TARGET}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _verdict(met: bool | None) -> str:
    return "-" if met is None else "pass" if met else "MISS"


def render(size: dict[str, Any], args: argparse.Namespace, console: Console) -> None:
    table = Table(title=f"prefix-routing: {size['prefix_words']} words (~{size['prefix_tokens_mean']:.0f} tokens) "
                        f"x {args.groups} groups, {args.requests} requests @ concurrency {args.concurrency}, "
                        f"{size['kv_cache_blocks']} KV blocks/worker")
    for column in ("policy", "runs", "ok", "TTFT mean ms", "p90 ms", "p99 ms", "cached %", "requests per worker"):
        table.add_column(column, justify="left" if column in ("policy", "requests per worker") else "right")
    for name, p in size["policies"].items():
        workers = "; ".join(" ".join(str(n) for n in run) for run in p["worker_requests"])
        table.add_row(name, str(p["runs"]), f"{p['requests_ok']}/{p['requests_total']}", _ms(p["ttft_ms_mean"]),
                      _ms(p["ttft_ms_p90"]), _ms(p["ttft_ms_p99"]), f"{100 * p['cached_fraction']:.1f}", workers)
    console.print(table)
    if size["mean_ratio_rr_over_kv"] is None:
        return
    target = "no target" if size["mean_target"] is None else f"target >= {size['mean_target']:g}"
    console.print(f"mean TTFT round-robin / kv = {size['mean_ratio_rr_over_kv']:.2f}x "
                  f"({target}: {_verdict(size['mean_target_met'])})")
    console.print(f"p99 TTFT kv / round-robin = {size['p99_ratio_kv_over_rr']:.2f}x "
                  f"(target <= {P99_TARGET:g}: {_verdict(size['p99_target_met'])})")


def _run_sizes(args: argparse.Namespace, sizes: list[int], policies: list[str], work_dir: Path,
               console: Console) -> list[dict[str, Any]]:
    from tokenmill.textgen.tokenizer import Tokenizer

    model = prepare_model(args, work_dir)
    tokenizer, words = Tokenizer(model), corpus_words()
    tokenizer.hf.model_max_length = 1 << 30  # here it only counts; the server checks its context
    workloads = [build_workload(words, n, tokenizer, args) for n in sizes]
    longest = max(len(s.prompt) for w in workloads for s in w.specs)
    fit_context(model, longest + args.max_tokens + 1, owned=args.model is None)
    batched = args.max_num_batched_tokens or max(512, -(-longest // 512) * 512)
    reports = []
    for workload in workloads:
        console.print(f"{workload.prefix_words} words: prefixes of {min(workload.prefix_tokens)}-"
                      f"{max(workload.prefix_tokens)} tokens; KV pool {workload.kv_cache_blocks} blocks per worker "
                      f"= {args.pool_fraction:.0%} of the {args.groups} prefixes' blocks")
        runs = [run_once(policy, repeat, workload, args, model, batched, work_dir)
                for repeat in range(args.repeats) for policy in policies]
        reports.append(size_report(workload, batched, runs))
        render(reports[-1], args, console)
    return reports


def run(args: argparse.Namespace) -> int:
    """0 when every request of every run completed, 1 otherwise (or a server failed), 2 for bad flags."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)  # a log file gets each row on one line
    with tempfile.TemporaryDirectory(prefix="tokenmill-prefix-routing-") as work:
        try:
            sizes, policies = _validate(args)
            reports = _run_sizes(args, sizes, policies, Path(work), console)
        except ValueError as exc:
            log.error("bench prefix-routing: %s", exc)
            return 2
        except RuntimeError as exc:  # a server that would not start, or a failed warm-up
            log.error("bench prefix-routing: %s", exc)
            return 1
    if args.json_path:
        config = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
        report = {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, "config": config, "sizes": reports}
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log.info("wrote %s", args.json_path)
    complete = all(p["requests_ok"] == p["requests_total"] for r in reports for p in r["policies"].values())
    return 0 if complete else 1
