"""`tokenmill bench planner-live`: the planner on a live mock fleet, against a static one and
against the simulator's prediction of the same run.

A trace slice (Azure conv by default, time-compressed with `--time-scale`) is replayed three
ways, all priced by one GPU profile (`--profile`, the workers' `--mock-profile`):
- `tokenmill serve --planner sla` starting from one worker: SLA attainment, and worker-hours
  integrated from `/admin/workers` once a second (starting, serving and draining workers count);
- a static `tokenmill serve` with the planned run's peak worker count;
- `tokenmill planner simulate` on the same slice and flags: the simulator's prediction.
Times are model time (the mock runs `--speedup` times faster and every measured time is scaled
back). JSON with `--json OUT`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

SCHEMA = "tokenmill.bench.planner_live/1"
SERVED = "planner-live"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint for the mock workers' vocabulary (default: tiny-dense)")
    parser.add_argument("--profile", default="llama-3.1-70b@h100:fp8:tp4")
    parser.add_argument("--trace", default="azure", help="azure (conv), mooncake, or a Mooncake-format JSONL")
    parser.add_argument("--max-requests", type=int, default=400)
    parser.add_argument("--time-scale", type=float, default=0.1, help="arrival times x this (0.1: ten times denser)")
    parser.add_argument("--max-input-tokens", type=int, default=2048)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--speedup", type=float, default=1.0, help="mock workers run this much faster than modelled")
    parser.add_argument("--ttft-ms", type=float, default=1000.0)
    parser.add_argument("--itl-ms", type=float, default=50.0)
    parser.add_argument("--planner-interval-s", type=float, default=5.0)
    parser.add_argument("--scale-down-intervals", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-blocks", type=int, default=4096)
    parser.add_argument("--json", dest="json_out", type=Path, default=None)


def _serve_flags(args: argparse.Namespace, model: str, planned: bool) -> list[str]:
    flags = ["--model", model, "--runner", "mock", "--mock-profile", args.profile, "--mock-speedup", str(args.speedup),
             "--served-model-name", SERVED, "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--kv-cache-blocks", str(args.kv_cache_blocks), "--router", "kv"]
    if planned:
        flags += ["--planner", "sla", "--predictor", "constant", "--planner-interval-s", str(args.planner_interval_s),
                  "--scale-down-intervals", str(args.scale_down_intervals), "--slo-ttft-ms", str(args.ttft_ms),
                  "--slo-itl-ms", str(args.itl_ms), "--warmup-s", str(2 * args.planner_interval_s)]
    return flags


async def _count_workers(url: str, stop: asyncio.Event, samples: list[tuple[float, int]]) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=10.0, trust_env=False) as client:
        while not stop.is_set():
            body = (await client.get("/admin/workers")).json()
            live = sum(1 for w in body["data"] if w["state"] in ("starting", "serving", "draining"))
            samples.append((time.monotonic(), live))
            await asyncio.sleep(1.0)


async def _replay(url: str, specs: list[Any]) -> tuple[list[Any], list[tuple[float, int]]]:
    from tokenmill.bench.harness import loadgen

    samples: list[tuple[float, int]] = []
    stop = asyncio.Event()
    counter = asyncio.create_task(_count_workers(url, stop, samples))
    target = loadgen.Target(url, SERVED, 600.0)
    async with loadgen.make_client(None) as client:
        records = loadgen.new_records(specs)
        await loadgen.run_open_loop(client, target, specs, records, lambda record: None)
    stop.set()
    await counter
    return records, samples


def _live(args: argparse.Namespace, model: str, trace: Path, workers: int, planned: bool, work: Path) -> dict[str, Any]:
    from tokenmill.bench.harness import loadgen
    from tokenmill.bench.harness.checkpoint import model_limits
    from tokenmill.bench.harness.serve_process import running_server
    from tokenmill.bench.harness.trace_replay import TraceFit, read_trace, trace_requests
    from tokenmill.workloads.prompt_synth import HashBlockSynth, TokenSpace

    _, vocab = model_limits(model)
    fit = TraceFit(args.time_scale / args.speedup, args.max_requests, args.max_input_tokens, args.max_output_tokens)
    specs = trace_requests(read_trace(trace, args.max_requests), HashBlockSynth(TokenSpace(vocab), 64, 0), fit)
    name = "planned" if planned else "static"
    with running_server(_serve_flags(args, model, planned), workers, work / f"run-{name}", work / f"{name}.log") as server:
        records, samples = asyncio.run(_replay(server.url, specs))
        decisions = _decisions(server.url) if planned else []
    k = args.speedup
    ok = [r for r in records if r.status == loadgen.OK]
    within = [r for r in ok if r.ttft_s * k <= args.ttft_ms / 1e3 and _itl(r) * k <= args.itl_ms / 1e3]
    hours = sum((t1 - t0) * n for (t0, n), (t1, _) in zip(samples, samples[1:])) * k / 3600
    return {"requests": len(records), "failed": len(records) - len(ok), "sla_attainment": len(within) / len(records),
            "worker_hours": hours, "peak_workers": max((n for _, n in samples), default=workers),
            "changes": sum(1 for d in decisions if d["actions"]), "reasons": [d["reason"] for d in decisions if d["actions"]]}


def _itl(record: Any) -> float:
    tokens = record.completion_tokens or 0
    return (record.token_times_s[-1] - record.token_times_s[0]) / (tokens - 1) if tokens > 1 else 0.0


def _decisions(url: str) -> list[dict[str, Any]]:
    import httpx

    return httpx.get(url + "/admin/planner", params={"last": "10000"}, timeout=10.0).json()["data"]


def _simulated(args: argparse.Namespace, trace: Path) -> dict[str, Any]:
    from tokenmill.planner.simulate import add_arguments as simulate_arguments
    from tokenmill.planner.simulate import simulate
    from tokenmill.sim.fleet.clock import parse_profile

    profile = parse_profile(args.profile)
    parser = argparse.ArgumentParser()
    simulate_arguments(parser)
    sim_args = parser.parse_args([
        "--trace", str(trace), "--tokens-per-hash-block", "64", "--time-scale", str(args.time_scale),
        "--max-requests", str(args.max_requests), "--max-input-tokens", str(args.max_input_tokens),
        "--max-output-tokens", str(args.max_output_tokens), "--model", profile.model, "--gpu", profile.gpu,
        "--precision", profile.precision, "--layout", profile.layout, "--agg", "1",
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-blocks", str(args.kv_cache_blocks),
        "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms), "--predictor", "constant",
        "--planner-interval-s", str(args.planner_interval_s), "--scale-down-intervals", str(args.scale_down_intervals),
        "--warmup-s", str(2 * args.planner_interval_s), "--replica-startup-s", "2", "--no-baselines",
        "--hold-window-s", "0"])  # as live, where the hold is off unless asked for
    planned = simulate(sim_args)["planned"]
    return {"sla_attainment": planned["sla_attainment"], "worker_hours": planned["gpu_hours"] / profile.gpus,
            "peak_workers": planned["peak_replicas"], "changes": planned["decisions_with_changes"]}


def run(args: argparse.Namespace) -> int:
    import logging

    from tokenmill.bench.fleet.fleet_agreement import prepare_trace

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the table

    with tempfile.TemporaryDirectory(prefix="tokenmill-planner-live-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from tokenmill.engine.make_model import write_model

            model = str(write_model("tiny-dense", work / "tiny-dense", seed=0))
        trace = prepare_trace(args.trace, args, work)
        planned = _live(args, model, trace, 1, True, work)
        static = _live(args, model, trace, max(planned["peak_workers"], 1), False, work)
        simulated = _simulated(args, trace)
    report = {"schema": SCHEMA, "profile": args.profile, "trace": args.trace, "planned": planned, "static": static,
              "simulated": simulated, "worker_hours_vs_static": planned["worker_hours"] / max(static["worker_hours"], 1e-9)}
    _print(report)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench planner-live: {report['profile']} mock fleet, {report['trace']} slice")
    for col in ("run", "SLA attainment", "worker-hours", "peak workers", "changes", "failed"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for name in ("planned", "static", "simulated"):
        row = report[name]
        table.add_row(name, f"{row['sla_attainment']:.2%}", f"{row['worker_hours']:.3f}", str(row["peak_workers"]),
                      str(row.get("changes", "-")), str(row.get("failed", "-")))
    Console().print(table)
    Console().print(f"planned / static worker-hours: {report['worker_hours_vs_static']:.2f}x")
