"""`tokenmill bench fleet-agreement`: the live mock fleet against the fleet simulator, same trace.

The same trace slice is replayed twice: through `tokenmill serve --runner mock --mock-profile P
--mock-speedup K` (real processes, the frontend's router, real sockets; arrivals K× faster and
every measured time multiplied back by K) and through `tokenmill sim fleet` with the same
profile, pool sizes, KV blocks and scheduler limits. Both read one Mooncake-format file (an
Azure slice is written into that format, one fresh hash id per block, since it shares nothing),
so their prompts have the same block structure (`sim.fleet.arrivals`, tested against bench's
`HashBlockSynth`). Reported per request: cached tokens identical; per run: TTFT p50/p90/p99,
per-request mean ITL p50/p99 and its mean, hit rate.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.harness import loadgen
from tokenmill.bench.harness.checkpoint import model_limits
from tokenmill.bench.harness.serve_process import running_server
from tokenmill.bench.harness.trace_replay import TraceFit, read_trace, trace_requests
from tokenmill.datasets import AZURE_CONV_TRACE, MOONCAKE_TRACE, data_dir
from tokenmill.workloads.prompt_synth import HashBlockSynth, RequestSpec, TokenSpace

log = logging.getLogger(__name__)
SCHEMA = "tokenmill.bench.fleet.fleet_agreement/1"
SERVED_NAME = "fleet-agreement"
MOONCAKE_BLOCK = 512
MODES = {"agg": {"workers": None}, "1p1d": {"prefill": 1, "decode": 1}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint the mock workers serve (its vocabulary only)")
    parser.add_argument("--profile", default="llama-3.1-70b@h100:fp8:tp4", help="MODEL@GPU[:precision][:layout]")
    parser.add_argument("--sources", default="mooncake,azure",
                        help="comma list of mooncake, azure (the shipped traces' first --max-requests records), "
                             "or paths of Mooncake-format JSONL slices")
    parser.add_argument("--modes", default="agg,1p1d", help="comma list of agg (--workers replicas), 1p1d")
    parser.add_argument("--workers", type=int, default=4, help="aggregated replicas")
    parser.add_argument("--max-requests", type=int, default=1000)
    parser.add_argument("--tokens-per-hash-block", type=int, default=64)
    parser.add_argument("--max-input-tokens", type=int, default=1024)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=1.0, help="arrival times x this (model time)")
    parser.add_argument("--threads", type=int, default=1, help="--live-runner torch: torch threads per worker "
                        "(as `sim calibrate --model --threads` timed them)")
    parser.add_argument("--speedup", type=float, default=1.0, help="the live mock fleet runs this many times faster")
    parser.add_argument("--live-runner", choices=("mock", "torch"), default="mock",
                        help="torch: the live fleet runs the real engine (then --profile should be "
                             "MODEL_DIR@cpu-local:bf16 after `tokenmill sim calibrate`)")
    parser.add_argument("--kv-cache-blocks", type=int, default=4096, help="per worker, both sides")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None, help="keep serve logs and traces here")
    parser.add_argument("--json", dest="json_out", type=Path, default=None)


# ---- the shared trace --------------------------------------------------------------------------

def prepare_trace(source: str, args: argparse.Namespace, work_dir: Path) -> Path:
    """The slice as a Mooncake-format file both sides read."""
    if source == "mooncake":
        lines = (data_dir() / MOONCAKE_TRACE).read_text().splitlines()[:args.max_requests]
        path = work_dir / "mooncake-slice.jsonl"
        path.write_text("\n".join(lines) + "\n")
        return path
    if source != "azure":
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"--sources: {source!r} is neither mooncake, azure nor a trace file")
        return path
    from tokenmill.sim.fleet.arrivals import load_trace

    rows = load_trace(data_dir() / AZURE_CONV_TRACE, max_requests=args.max_requests)
    path, next_id, out = work_dir / "azure-slice.jsonl", 0, []
    for r in rows:
        blocks = math.ceil(r.input_tokens / MOONCAKE_BLOCK)
        out.append(json.dumps({"timestamp": round(r.arrival_s * 1000.0, 3), "input_length": r.input_tokens,
                               "output_length": r.output_tokens, "hash_ids": list(range(next_id, next_id + blocks))}))
        next_id += blocks
    path.write_text("\n".join(out) + "\n")
    return path


# ---- the live side ----------------------------------------------------------------------------

def _serve_flags(args: argparse.Namespace, mode: str) -> tuple[list[str], int]:
    runner = (["--runner", "mock", "--mock-profile", args.profile, "--mock-speedup", str(args.speedup)]
              if args.live_runner == "mock" else ["--runner", "torch", "--threads", str(args.threads)])
    flags = ["--model", args.model, *runner, "--router", "kv", "--kv-cache-blocks", str(args.kv_cache_blocks),
             "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--served-model-name", SERVED_NAME, "--seed", str(args.seed)]
    if mode == "1p1d":
        return flags + ["--prefill", "1", "--decode", "1"], 2
    return flags, args.workers


async def _replay(url: str, specs: list[RequestSpec]) -> list[loadgen.RequestRecord]:
    target = loadgen.Target(url, SERVED_NAME, 600.0)
    async with loadgen.make_client(None) as client:
        warm = loadgen.RequestRecord(-1, 8, 2)  # below one KV block: caches nothing
        await loadgen.send_one(client, target, RequestSpec(list(range(3, 11)), 2), warm, 0.0)
        records = loadgen.new_records(specs)
        await loadgen.run_open_loop(client, target, specs, records, lambda record: None)
    return records


def live_run(trace: Path, args: argparse.Namespace, mode: str, work_dir: Path) -> list[dict[str, Any]]:
    """Per request (file order): cached tokens, TTFT and mean ITL in model seconds."""
    _, vocab = model_limits(args.model)
    fit = TraceFit(args.time_scale / args.speedup, args.max_requests, args.max_input_tokens, args.max_output_tokens)
    specs = trace_requests(read_trace(trace, args.max_requests),
                           HashBlockSynth(TokenSpace(vocab), args.tokens_per_hash_block, args.seed), fit)
    flags, workers = _serve_flags(args, mode)
    with running_server(flags, workers, work_dir / f"run-{trace.stem}-{mode}", work_dir / f"serve-{trace.stem}-{mode}.log") as server:
        records = asyncio.run(_replay(server.url, specs))
    failed = [r for r in records if r.status != loadgen.OK]
    if failed:
        raise RuntimeError(f"{len(failed)} live requests failed, e.g. {failed[0].status} {failed[0].error}")
    k = args.speedup
    return [{"cached": r.cached_tokens or 0, "prompt": r.prompt_len, "ttft": r.ttft_s * k,
             "itl": _mean_itl(r) * k if (r.completion_tokens or 0) > 1 else None} for r in records]


def _mean_itl(r: loadgen.RequestRecord) -> float:
    """(last token − first token) ÷ (tokens − 1): a stream event may carry several tokens (text
    held back until it is whole), so counting events would overstate the gaps."""
    return (r.token_times_s[-1] - r.token_times_s[0]) / ((r.completion_tokens or 0) - 1)


# ---- the simulated side ------------------------------------------------------------------------

def sim_run(trace: Path, args: argparse.Namespace, mode: str) -> list[dict[str, Any]]:
    from tokenmill.sim.fleet.arrivals import load_trace
    from tokenmill.sim.fleet.clock import parse_profile
    from tokenmill.sim.fleet.config import FleetConfig
    from tokenmill.sim.fleet.fleet import FleetSim

    requests = load_trace(trace, tokens_per_hash_block=args.tokens_per_hash_block, time_scale=args.time_scale,
                          max_requests=args.max_requests, max_input_tokens=args.max_input_tokens,
                          max_output_tokens=args.max_output_tokens)
    profile = parse_profile(args.profile)
    pools = {"agg": args.workers} if mode == "agg" else {"prefill": 1, "decode": 1}
    config = FleetConfig(profiles={"agg": profile, "prefill": profile, "decode": profile}, **pools, router="kv",
                         kv_blocks=args.kv_cache_blocks, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)
    sim = FleetSim(config)
    sim.run(requests)
    rejected = [r for r in sim.records.values() if not r.finished]
    if rejected:
        raise RuntimeError(f"the simulator did not serve {len(rejected)} requests, e.g. {rejected[0].rejected}")
    # the simulator numbers requests by arrival (ties in file order); put them back in file order
    arrivals = [r.timestamp_ms for r in read_trace(trace, args.max_requests)]
    file_order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i))
    rows: list[dict[str, Any]] = [{}] * len(file_order)
    for rank, index in enumerate(file_order):
        r = sim.records[f"r{rank}"]
        rows[index] = {"cached": r.cached_tokens, "prompt": r.input_tokens, "ttft": r.ttft_s, "itl": r.itl_mean_s}
    return rows


# ---- comparison -------------------------------------------------------------------------------

def compare(live: list[dict[str, Any]], sim: list[dict[str, Any]]) -> dict[str, Any]:
    if len(live) != len(sim):
        raise RuntimeError(f"live replayed {len(live)} requests, the simulator {len(sim)}")
    same = sum(1 for a, b in zip(live, sim) if a["cached"] == b["cached"])
    out: dict[str, Any] = {"requests": len(live), "cached_identical": same / len(live)}
    for side, rows in (("live", live), ("sim", sim)):
        ttft = np.array([r["ttft"] for r in rows])
        itl = np.array([r["itl"] for r in rows if r["itl"] is not None])
        out[side] = {"ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
                     "ttft_p99_s": float(np.percentile(ttft, 99)),
                     "itl_p50_s": float(np.percentile(itl, 50)) if itl.size else None,
                     "itl_p99_s": float(np.percentile(itl, 99)) if itl.size else None,
                     "itl_mean_s": float(itl.mean()) if itl.size else None,
                     "hit_rate": sum(r["cached"] for r in rows) / max(sum(r["prompt"] for r in rows), 1)}
    out["ratio"] = {k: (out["sim"][k] / out["live"][k] if out["live"][k] else None)
                    for k in out["live"] if out["live"][k] is not None and out["sim"][k] is not None}
    return out


def agreement(source: str, mode: str, args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    trace = prepare_trace(source, args, work_dir)
    result = compare(live_run(trace, args, mode, work_dir), sim_run(trace, args, mode))
    return {"source": Path(source).stem if source not in ("mooncake", "azure") else source, "mode": mode, **result}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"--modes: unknown mode {mode!r} (agg, 1p1d)")
    if args.speedup <= 0 or (args.live_runner == "torch" and args.speedup != 1):
        raise ValueError(f"--speedup must be > 0 (and 1 with --live-runner torch), got {args.speedup}")
    with tempfile.TemporaryDirectory(prefix="fleet-agreement-") as tmp:
        work_dir = args.work_dir or Path(tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        rows = [agreement(source, mode, args, work_dir) for source in sources for mode in modes]
    report = {"schema": SCHEMA, "profile": args.profile, "speedup": args.speedup, "live_runner": args.live_runner,
              "rows": rows}
    Console(width=200).print(render_table(report))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def render_table(report: dict[str, Any]):
    from rich.table import Table

    table = Table(title=f"live {report['live_runner']} fleet vs fleet simulator ({report['profile']}, "
                        f"live x{report['speedup']:g})")
    for col in ("slice", "mode", "n", "cached same", "TTFT p50 live/sim ms", "TTFT p90", "TTFT p99",
                "ITL p50 live/sim ms", "ITL p99", "mean ITL", "hit rate live/sim"):
        table.add_column(col, justify="right")
    for row in report["rows"]:
        live, sim = row["live"], row["sim"]

        def pair(key: str, scale: float = 1e3) -> str:
            return "-" if live[key] is None or sim[key] is None else f"{live[key] * scale:.1f}/{sim[key] * scale:.1f}"

        table.add_row(row["source"], row["mode"], str(row["requests"]), f"{row['cached_identical']:.1%}",
                      pair("ttft_p50_s"), pair("ttft_p90_s"), pair("ttft_p99_s"), pair("itl_p50_s"),
                      pair("itl_p99_s"), pair("itl_mean_s"), f"{live['hit_rate']:.1%}/{sim['hit_rate']:.1%}")
    return table
