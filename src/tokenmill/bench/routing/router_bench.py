"""`tokenmill bench router`: the KV router's hot paths, single process, no network.

1. Build: a `Router(policy="kv")` over `--workers` workers whose KV events leave `--blocks`
   (worker, block) entries in the index: shared-prefix chains (see `router_workload`),
   applied as whole-sequence stored events (re-announced prefixes included).
2. Decisions: `--decisions` prompts of `--prompt-tokens` tokens (a popular prefix cut at a
   random depth + unique blocks), hashes precomputed; each `Router.select` is timed on its
   own (scoring every worker, building the decision, charging load). Requests finish
   `--window` decisions later, so load varies. Hashing one such prompt with
   `kv.hashing.block_hashes` is timed separately and reported beside it.
3. Events: `--events` steady-state events through `Router.apply_event`, shaped like a
   tokenmill worker's (see `router_workload.event_stream`): per request, its uncached prompt
   in stored chunks of `--chunk-tokens`, then one stored block per 16 of `--output-tokens`,
   each stored event preceded by an eviction of the same size: events/s and blocks/s.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenmill.bench.harness.router_workload import ChainFactory, build_fleet, decision_prompts, event_stream
from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE, block_hashes
from tokenmill.router.decision import RoutingRequest
from tokenmill.router.indexer import ApplyStatus
from tokenmill.router.policies import Router, RouterConfig

log = logging.getLogger(__name__)

TARGET_P99_MS = 1.0
TARGET_EVENTS_PER_S = 200_000


@dataclass(slots=True)
class RouterBenchReport:
    workers: int
    index_blocks: int
    index_hashes: int
    prompt_tokens: int
    prompt_blocks: int
    build_s: float
    build_blocks_per_s: float
    decisions: int
    decisions_per_s: float
    decision_p50_ms: float
    decision_p99_ms: float
    decision_max_ms: float
    mean_overlap_blocks: float
    mean_matched_workers: float
    hash_prompt_p50_ms: float
    events: int
    event_mean_blocks: float
    events_per_s: float
    event_blocks_per_s: float

    def meets_targets(self) -> dict[str, bool]:
        return {"decision_p99_below_1ms": self.decision_p99_ms < TARGET_P99_MS,
                "events_per_s_at_least_200k": self.events_per_s >= TARGET_EVENTS_PER_S}

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "targets": self.meets_targets()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="(worker, block) entries to index")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--decisions", type=int, default=5000)
    parser.add_argument("--window", type=int, default=256, help="requests in flight during decisions")
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--output-tokens", type=int, default=512, help="per request, for the event mix")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk, for the event mix")
    parser.add_argument("--prefixes", type=int, default=512, help="distinct shared prefixes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None, help="write the report here")


def run(args: argparse.Namespace) -> int:
    for name in ("workers", "blocks", "prompt_tokens", "block_size", "decisions", "events", "prefixes",
                 "output_tokens", "chunk_tokens"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.prompt_tokens < args.block_size:
        raise ValueError("--prompt-tokens must hold at least one block")
    report = measure(args)
    render_table(report)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0


def measure(args: argparse.Namespace) -> RouterBenchReport:
    prompt_blocks = args.prompt_tokens // args.block_size
    chains = ChainFactory(args.prefixes, prompt_blocks, args.seed)
    log.info("generating %d blocks over %d workers", args.blocks, args.workers)
    fleet = build_fleet(chains, args.workers, args.blocks, prompt_blocks)
    router = Router(RouterConfig(policy="kv", block_size=args.block_size), rng=random.Random(args.seed))
    for worker in fleet.workers:
        router.add_worker(worker)
    started = time.perf_counter()
    for event in fleet.build_events:
        router.apply_event(event)
    build_s = time.perf_counter() - started
    indexer = router.indexer
    if indexer is None:
        raise RuntimeError("a kv router always has an indexer")
    index_blocks, index_hashes = indexer.num_blocks(), indexer.num_hashes()
    prompts = decision_prompts(chains, args.decisions, prompt_blocks)
    events = event_stream(fleet, chains, args.events, prompt_blocks, max(1, args.output_tokens // args.block_size),
                          max(1, args.chunk_tokens // args.block_size))
    gc.collect()
    gc.freeze()  # the index is long-lived: keep the collector from rescanning it (as a server would)
    latencies, overlaps, matched, decide_s = _time_decisions(router, prompts, args.prompt_tokens, args.window)
    events_s = _time_events(router, events)
    gc.unfreeze()
    event_blocks = sum(len(getattr(e, "hashes", ())) for e in events)
    return RouterBenchReport(
        workers=args.workers, index_blocks=index_blocks, index_hashes=index_hashes,
        prompt_tokens=args.prompt_tokens, prompt_blocks=prompt_blocks, build_s=build_s,
        build_blocks_per_s=sum(len(e.hashes) for e in fleet.build_events) / build_s,
        decisions=len(latencies), decisions_per_s=len(latencies) / decide_s,
        decision_p50_ms=_quantile_ms(latencies, 0.50), decision_p99_ms=_quantile_ms(latencies, 0.99),
        decision_max_ms=max(latencies) * 1e3, mean_overlap_blocks=statistics.fmean(overlaps),
        mean_matched_workers=statistics.fmean(matched),
        hash_prompt_p50_ms=_hash_p50_ms(args.prompt_tokens, args.block_size, args.seed),
        events=len(events), event_mean_blocks=event_blocks / len(events), events_per_s=len(events) / events_s,
        event_blocks_per_s=event_blocks / events_s)


def _time_decisions(router: Router, prompts: list[list[int]], prompt_tokens: int,
                    window: int) -> tuple[list[float], list[int], list[int], float]:
    latencies, overlaps, matched = [], [], []
    timer = time.perf_counter
    started = timer()
    for i, hashes in enumerate(prompts):
        request = RoutingRequest(f"r{i}", hashes, prompt_tokens)
        before = timer()
        decision = router.select(request)
        latencies.append(timer() - before)
        overlaps.append(decision.overlap_blocks)
        matched.append(sum(1 for t in decision.terms if t.overlap))
        if i >= window:
            router.on_finished(f"r{i - window}")
    return latencies, overlaps, matched, timer() - started


def _time_events(router: Router, events: list) -> float:
    apply = router.apply_event
    started = time.perf_counter()
    statuses = [apply(event) for event in events]
    elapsed = time.perf_counter() - started
    if any(status is not ApplyStatus.APPLIED for status in statuses):
        raise RuntimeError("the synthetic event stream should apply without gaps")
    return elapsed


def _hash_p50_ms(prompt_tokens: int, block_size: int, seed: int) -> float:
    rng = random.Random(seed)
    samples = []
    for _ in range(50):
        tokens = [rng.randrange(150_000) for _ in range(prompt_tokens)]
        before = time.perf_counter()
        block_hashes(tokens, block_size)
        samples.append(time.perf_counter() - before)
    return statistics.median(samples) * 1e3


def _quantile_ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def render_table(report: RouterBenchReport) -> None:
    from rich.console import Console
    from rich.table import Table

    targets = report.meets_targets()
    table = Table(title=f"tokenmill bench router — {report.workers} workers, "
                        f"{report.index_blocks:,} indexed blocks, {report.prompt_tokens}-token prompts")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("index build (whole-sequence stored events)", f"{report.build_s:.2f} s, {report.build_blocks_per_s:,.0f} blocks/s"),
        ("distinct hashes in the index", f"{report.index_hashes:,}"),
        ("decisions/s", f"{report.decisions_per_s:,.0f}"),
        ("decision latency p50 / p99 / max",
         f"{report.decision_p50_ms:.3f} / {report.decision_p99_ms:.3f} / {report.decision_max_ms:.3f} ms"),
        ("  target p99 < 1 ms", "met" if targets["decision_p99_below_1ms"] else "MISSED"),
        ("mean overlap of chosen worker / workers matched",
         f"{report.mean_overlap_blocks:.1f} blocks / {report.mean_matched_workers:.1f}"),
        ("hashing one prompt (block_hashes, not in the above) p50", f"{report.hash_prompt_p50_ms:.3f} ms"),
        ("events applied/s (engine-shaped stored/removed mix)", f"{report.events_per_s:,.0f}"),
        ("  mean blocks per event", f"{report.event_mean_blocks:.2f}"),
        ("  blocks/s in those events", f"{report.event_blocks_per_s:,.0f}"),
        ("  target >= 200k events/s", "met" if targets["events_per_s_at_least_200k"] else "MISSED"),
    ]
    for label, value in rows:
        table.add_row(label, value)
    Console().print(table)
