"""`tokenmill bench BENCHMARK …`: one nested sub-command per benchmark.

Each benchmark is one module exposing `add_arguments(parser)` and `run(args) -> int`,
registered in `BENCHMARKS` below, exactly like the top-level `tokenmill` sub-commands.
Benchmark modules import torch/transformers inside `run`, so `tokenmill bench --help`
stays fast.
"""
from __future__ import annotations

import argparse

from tokenmill.cli import add_subcommands

# (name, module, one-line help)
BENCHMARKS: tuple[tuple[str, str, str], ...] = (
    ("engine", "tokenmill.bench.engine.engine_cli",
     "embedded engine vs transformers generate(), with the decode step's memory floor"),
    ("serve", "tokenmill.bench.serving.serve_bench",
     "load generator: fixed concurrency, Poisson rate or Mooncake trace replay against an OpenAI server"),
    ("router", "tokenmill.bench.routing.router_bench",
     "KV router hot paths: decisions/s and latency over a 1M-block index, KV events applied/s"),
    ("events", "tokenmill.bench.events.events_bench",
     "KV events from 64 synthetic workers over NATS vs the embedded ZeroMQ path: events/s, p99 event-to-index"),
    ("transfer", "tokenmill.bench.kv.transfer_bench",
     "KV-block transfers over shm and tcp between two processes, next to raw memcpy and socket"),
    ("connector", "tokenmill.bench.kv.connector_bench",
     "KV pulls through the vLLM connector's worker side vs plain transfer-agent reads of the same bytes (tcp)"),
    ("router-replay", "tokenmill.bench.routing.router_replay",
     "a Mooncake trace through tokenmill serve (mock workers) under each routing policy: TTFT, prefill, hits"),
    ("prefix-routing", "tokenmill.bench.routing.prefix_routing_bench",
     "shared-prefix load through tokenmill serve (mock workers), kv vs round-robin: TTFT mean/p99, hits"),
    ("tiers", "tokenmill.bench.kv.tiers_bench",
     "KV tiers on small-moe: agentic TTFT with host+disk vs device-only, cross-replica TTFT via a shared tier"),
    ("disagg", "tokenmill.bench.kv.disagg_bench",
     "prefill/decode interference on small-moe: aggregated vs disaggregated TTFT, ITL p50/p99, output tok/s"),
    ("choices", "tokenmill.bench.engine.choices_bench",
     "n=4 choices in one request vs 4 separate requests of the same prompt: output tok/s, prompt tokens computed"),
    ("speculative", "tokenmill.bench.engine.speculative_bench",
     "speculative decoding (n-gram or a draft model) vs plain decoding on code edits (SmolLM2): output tok/s, acceptance"),
    ("structured", "tokenmill.bench.engine.structured_bench",
     "json_schema decoding vs plain on small-moe: ms per output token, the grammar's overhead per token"),
    ("planner", "tokenmill.bench.fleet.planner_bench",
     "the SLA planner in the fleet simulator: attainment and GPU-hours against static peak and an oracle"),
    ("planner-live", "tokenmill.bench.fleet.planner_live_bench",
     "the planner on a live mock fleet (serve --planner) vs a static fleet and the simulator's prediction"),
    ("fleet-agreement", "tokenmill.bench.fleet.fleet_agreement",
     "the live mock fleet (--mock-profile) against the fleet simulator on the same trace slice"),
    ("fleet-sim", "tokenmill.bench.fleet.fleet_sim_bench",
     "fleet simulator speed: the whole Azure conv trace on the fleet it needs, wall time on one core"),
    ("demo", "tokenmill.bench.demo.demo_bench",
     "each dashboard scenario under each toggle state (off, disaggregation, +KV routing, +managed cache): a table, a PNG"),
    ("frontend", "tokenmill.bench.serving.frontend_bench",
     "serving hot path: wrk against tokenmill serve with instant mock workers: req/s, latency, CPU/1k req, RSS"),
    ("router-warmup", "tokenmill.bench.routing.router_warmup_bench",
     "a fresh frontend over mock workers holding 1M cached blocks: seconds to a warm index and KV-aware routing"),
    ("replay", "tokenmill.bench.serving.replay_bench",
     "the same seeded requests through serve twice, in different orders under load, with and without --deterministic"),
    ("tenants", "tokenmill.bench.serving.tenants_bench",
     "an interactive tenant beside a batch tenant's flood on a mock GPU fleet, with and without priority classes"),
    ("engines", "tokenmill.bench.engines.engines_bench",
     "serving engines on one load, sides alternating: tokenmill+vLLM vs vLLM alone, kv vs rr, own engine vs vLLM"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # not `_run`: the top-level parser already uses that name for `bench` itself
    add_subcommands(parser, BENCHMARKS, "benchmark", "_bench_run")


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
