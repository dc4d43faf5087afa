"""`tokenmill bench demo`: the dashboard's story, offline. Each built-in scenario (risk synthesis,
the trial-protocol agents) runs for a fixed time under each state of the dashboard's toggles:

  everything off     aggregated workers, round-robin routing, device KV only
  disaggregation     half of them prefill, half decode (re-roled live: equal hardware)
  + KV routing       the decode pool routed by KV overlap
  + managed cache    the host KV tier on

against one `tokenmill serve` whose toggles are switched through `/admin/settings`, exactly as
the page does. The load is the scenario's own requests (`workloads.demo.scenario_specs`, a new
seed per state so no state reuses another's prompts) streamed open-loop by the bench's client;
a trial run starts with one unmeasured turn of each agent (a deployment in its steady state,
not a cold one); the table has TTFT mean/p50/p90 and ITL p50/p99 as the client saw them, the prefix hits by tier
from `/metrics` over the run (`dashboard.figures`), and the cost per million output tokens
(workers x the price of a worker-hour x the run's hours / its output tokens).

`--mock MODEL@GPU[:precision][:layout]` runs mock workers clocked by that profile instead (they
hold no KV: the managed-cache state is skipped) and puts the fleet simulator's prediction of each
run beside it: the same token ids, arrivals and output lengths replayed in `sim.fleet`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenmill.bench.harness.loadgen import Target

log = logging.getLogger(__name__)

STATES: tuple[tuple[str, dict[str, bool]], ...] = (
    ("everything off", {"disaggregation": False, "kv_routing": False, "managed_cache": False}),
    ("disaggregation", {"disaggregation": True, "kv_routing": False, "managed_cache": False}),
    ("+ KV routing", {"disaggregation": True, "kv_routing": True, "managed_cache": False}),
    ("+ managed cache", {"disaggregation": True, "kv_routing": True, "managed_cache": True}),
)
SCENARIOS = ("risk", "trial")
REQUEST_TIMEOUT_S = 600.0
WARMUP_CONCURRENCY = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=".models/small-moe", help="a local checkpoint (make demo makes small-moe)")
    parser.add_argument("--mock", default=None, metavar="MODEL@GPU",
                        help="mock workers clocked by this profile, beside the fleet simulator's prediction")
    parser.add_argument("--mock-speedup", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2, help="workers in every state (aggregated or split)")
    parser.add_argument("--kv-cache-blocks", type=int, default=400,
                        help="each worker's device KV pool (small, so the agents' contexts overflow it)")
    parser.add_argument("--kv-host-gb", type=float, default=2.0, help="each worker's host KV tier")
    parser.add_argument("--duration-s", type=float, default=60.0, help="load per scenario and state")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--rate-risk", type=float, default=0.1, help="risk-synthesis requests per second")
    parser.add_argument("--rate-trial", type=float, default=0.15, help="agent turns per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--usd-per-worker-hour", type=float, default=1.0,
                        help="the price of a worker-hour (with --mock: its GPUs at $3 per GPU-hour)")
    parser.add_argument("--json", dest="json_out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="a PNG: each scenario's figures by state")


def check(args: argparse.Namespace) -> list[str]:
    """The scenarios asked for; ValueError naming the flag."""
    scenarios = [s for s in args.scenarios.split(",") if s]
    for name in scenarios:
        if name not in SCENARIOS:
            raise ValueError(f"--scenarios: {name!r} is not one of {', '.join(SCENARIOS)}")
    if args.workers < 2:
        raise ValueError("--workers must be at least 2 (disaggregation splits them into prefill and decode)")
    for flag in ("duration_s", "rate_risk", "rate_trial", "mock_speedup"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
    if not Path(args.model, "config.json").is_file():
        raise ValueError(f"--model: no checkpoint at {args.model} (make demo writes .models/small-moe)")
    return scenarios


def run(args: argparse.Namespace) -> int:
    from tokenmill.bench.demo.demo_report import print_table, write_plot
    from tokenmill.bench.harness.serve_process import start_serve, stop

    try:
        scenarios = check(args)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the table
    run_dir = Path(tempfile.mkdtemp(prefix="tokenmill-bench-demo-"))
    server = start_serve(_serve_flags(args), args.workers, run_dir, run_dir / "serve.log", start_timeout_s=300)
    try:
        context = min(int(entry["metadata"]["max_model_len"]) for entry in server.registry())
        rows = asyncio.run(_all_runs(server.url, args, scenarios, context))
    finally:
        stop(server)
        shutil.rmtree(run_dir, ignore_errors=True)
    report = {"schema": "tokenmill.bench.demo/1", "model": args.model, "mock": args.mock, "workers": args.workers,
              "duration_s": args.duration_s, "rows": rows}
    print_table(rows, mock=args.mock is not None)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    if args.plot:
        write_plot(rows, args.plot)
    return 0


def _serve_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model, "--router", "kv", "--kv-cache-blocks", str(args.kv_cache_blocks)]
    if args.mock:
        return flags + ["--runner", "mock", "--mock-profile", args.mock, "--mock-speedup", str(args.mock_speedup)]
    return flags + ["--kv-host-gb", str(args.kv_host_gb), "--usd-per-worker-hour", str(args.usd_per_worker_hour)]


async def _all_runs(url: str, args: argparse.Namespace, scenarios: list[str], context: int) -> list[dict[str, Any]]:
    """Every scenario under every state, in turn; `context` is the longest prompt a worker takes."""
    from tokenmill.textgen.tokenizer import Tokenizer

    tokenizer = Tokenizer(args.model)
    states = [s for s in STATES if not (args.mock and s[1]["managed_cache"])]
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=10.0), trust_env=False) as admin:
        model = (await admin.get("/v1/models")).json()["data"][0]["id"]
        for scenario in scenarios:
            rate = args.rate_risk if scenario == "risk" else args.rate_trial
            for index, (label, toggles) in enumerate(states):
                await _set_state(admin, toggles)
                seed = args.seed + 1000 * SCENARIOS.index(scenario) + index  # fresh prompts in every state
                row = await _one_run(admin, Target(url, model, REQUEST_TIMEOUT_S), scenario, label, rate, seed,
                                     tokenizer, context, args)
                log.info("%s / %s: %s", scenario, label, {k: row[k] for k in ("ttft_mean_ms", "itl_p99_ms")})
                rows.append(row)
    return rows


async def _one_run(admin: httpx.AsyncClient, target: Target, scenario: str, label: str, rate: float,
                   seed: int, tokenizer: Any, context: int, args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.bench.harness.loadgen import make_client, new_records, run_closed_loop, run_open_loop
    from tokenmill.workloads.demo import scenario_specs

    warmup, specs = scenario_specs(scenario, seed, rate, args.duration_s,
                                   lambda messages: tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                   lambda text: len(tokenizer.encode(text)), context)
    warmup_started = time.time()
    async with make_client(None) as client:
        if warmup:  # not measured: the caches of a deployment already in its steady state
            await run_closed_loop(client, target, warmup, new_records(warmup), WARMUP_CONCURRENCY, lambda _: None)
            await _settled_metrics_text(admin)
        before, started = await _metrics_text(admin), time.time()
        records = new_records(specs)
        await run_open_loop(client, target, specs, records, lambda _: None)
    seconds = time.time() - started
    after = await _settled_metrics_text(admin)
    workers = await admin.get("/admin/workers")
    row = summarize(scenario, label, records, seconds, before, after, workers.json(), _price(args))
    if args.mock:
        from tokenmill.bench.demo.demo_report import simulate_run

        row["simulated"] = simulate_run(warmup, specs, started - warmup_started, label, args)
    return row


def summarize(scenario: str, label: str, records: list[Any], seconds: float, before: str, after: str,
              workers: dict[str, Any], usd_per_worker_hour: float) -> dict[str, Any]:
    """One row: the client's latencies, `/metrics`' hits over the run, the cost of its worker-hours."""
    from prometheus_client.parser import text_string_to_metric_families

    from tokenmill.api.dashboard.figures import snapshot, window

    ok = [r for r in records if r.status == "ok"]
    ttft = np.array([r.ttft_s for r in ok if r.ttft_s is not None]) * 1e3
    gaps = np.array([g for r in ok for g in r.itl_s]) * 1e3
    per_request_itl = np.array([np.mean(r.itl_s) for r in ok if r.itl_s]) * 1e3
    figures = window(snapshot(text_string_to_metric_families(before), 0.0),
                     snapshot(text_string_to_metric_families(after), seconds), block_size=16)
    tokens = sum(r.completion_tokens or 0 for r in ok)
    serving = sum(states.get("serving", 0) for states in workers.get("replicas", {}).values())
    cost = usd_per_worker_hour * serving * seconds / 3600 / tokens * 1e6 if tokens else None
    return {"scenario": scenario, "state": label, "requests": len(records), "failed": len(records) - len(ok),
            "seconds": seconds, "output_tokens": tokens,
            "ttft_mean_ms": _stat(ttft, "mean"), "ttft_p50_ms": _stat(ttft, 50), "ttft_p90_ms": _stat(ttft, 90),
            "itl_p50_ms": _stat(gaps, 50), "itl_p99_ms": _stat(gaps, 99),
            "itl_mean_p50_ms": _stat(per_request_itl, 50), "itl_mean_p99_ms": _stat(per_request_itl, 99),
            "hit_rate": figures["hit_rate"], "prefill_computed_tokens": figures["prefill_computed_tokens"],
            "prefill_reused_tokens": figures["prefill_reused_tokens"], "workers": serving,
            "usd_per_million_output_tokens": cost}


def _stat(values: np.ndarray, which: str | int) -> float | None:
    if not len(values):
        return None
    return float(values.mean()) if which == "mean" else float(np.percentile(values, which))


def _price(args: argparse.Namespace) -> float:
    if not args.mock:
        return args.usd_per_worker_hour
    from tokenmill.serve_cli import profile_worker_hour
    from tokenmill.sim.fleet.clock import parse_profile

    return profile_worker_hour(parse_profile(args.mock).gpus, args.mock_speedup)


async def _set_state(admin: httpx.AsyncClient, toggles: dict[str, bool]) -> None:
    """Switch what differs, then wait until no re-roling is under way."""
    current = (await admin.get("/admin/settings")).json()
    wanted = {k: v for k, v in toggles.items() if current.get(k) is not None and current[k] != v}
    if wanted:
        reply = await admin.post("/admin/settings", json=wanted)
        reply.raise_for_status()
    while (state := (await admin.get("/admin/settings")).json())["busy"] is not None:
        await asyncio.sleep(0.5)
    if state["last_error"]:
        raise RuntimeError(f"re-roling failed: {state['last_error']}")


async def _metrics_text(admin: httpx.AsyncClient) -> str:
    return (await admin.get("/metrics")).text


async def _settled_metrics_text(admin: httpx.AsyncClient, tries: int = 20) -> str:
    """`/metrics` once the workers' counters (they ride the heartbeats) stop moving."""
    last = await _metrics_text(admin)
    for _ in range(tries):
        await asyncio.sleep(1.0)
        text = await _metrics_text(admin)
        if _worker_lines(text) == _worker_lines(last):
            return text
        last = text
    return last


def _worker_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("tokenmill_worker_")]

