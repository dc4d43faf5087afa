"""`tokenmill sim fleet`: replay a trace (or synthetic load) over a simulated GPU fleet.

    tokenmill sim fleet --trace conv.csv --rate-scale 8 --model llama-3.1-70b --gpu h100 \\
        --agg 16 --layout tp4 --router kv --ttft-ms 2000 --itl-ms 50 --json out.json --plot out.png

Bad input (a malformed trace line, an unknown model or GPU, a layout that does not fit memory,
a target <= 0) exits 2 with one line naming the field; nothing is written then.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path

from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE
from tokenmill.router.disagg import DisaggConfig
from tokenmill.sim.fleet.arrivals import TraceRequest, load_trace
from tokenmill.sim.fleet.clock import Profile, parse_layout
from tokenmill.sim.fleet.config import SLA, FleetChange, FleetConfig
from tokenmill.sim.fleet.report import FleetResult, run_fleet
from tokenmill.sim.fleet.synthetic import synthetic
from tokenmill.sim.pareto import DEFAULT_USD_PER_GPU_HOUR

log = logging.getLogger(__name__)
PROGRESS_MIN_REQUESTS = 20_000  # below this a run takes about a second: no bar


def add_arguments(sub: argparse._SubParsersAction) -> None:
    add_fleet_arguments(sub.add_parser("fleet", help="replay a trace over a simulated fleet (discrete-event)"))


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    """The load, fleet and target flags (`tokenmill planner simulate` takes the same)."""
    load = p.add_argument_group("load")
    load.add_argument("--trace", default=None, help="Mooncake JSONL or Azure 2023 CSV")
    load.add_argument("--synthetic", choices=("poisson", "gamma", "day"), default=None,
                      help="synthetic arrivals instead of a trace (with --rate and --duration-s)")
    load.add_argument("--rate", type=float, default=1.0, help="synthetic: mean requests/s")
    load.add_argument("--duration-s", type=float, default=600.0, help="synthetic: seconds of arrivals")
    load.add_argument("--isl", type=int, default=1024, help="synthetic: mean input tokens")
    load.add_argument("--osl", type=int, default=256, help="synthetic: mean output tokens")
    load.add_argument("--cv", type=float, default=1.0, help="synthetic gamma: coefficient of variation of gaps")
    load.add_argument("--period-s", type=float, default=86_400.0, help="synthetic day: period")
    load.add_argument("--peak-to-trough", type=float, default=4.0, help="synthetic day: peak/trough rate")
    load.add_argument("--rate-scale", type=float, default=1.0,
                      help="grow the trace K-fold by superposing time-shifted copies (keeps its shape)")
    load.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (0.5: twice as fast)")
    load.add_argument("--max-requests", type=int, default=None)
    load.add_argument("--max-input-tokens", type=int, default=None)
    load.add_argument("--max-output-tokens", type=int, default=None)
    load.add_argument("--tokens-per-hash-block", type=int, default=512, help="Mooncake: tokens per hash id")
    fleet = p.add_argument_group("fleet")
    fleet.add_argument("--model", required=True, help="built-in name or HF config.json path")
    fleet.add_argument("--gpu", required=True, help="h100 h200 b200 b300 gb200 gb300 cpu-local")
    fleet.add_argument("--precision", default="fp8")
    fleet.add_argument("--backend", default=None, help="whose fitted tuning (trtllm, vllm, sglang)")
    fleet.add_argument("--agg", type=int, default=0, help="aggregated replicas")
    fleet.add_argument("--layout", default="tp1", help="aggregated replicas' layout, e.g. tp4, tp2ep2")
    fleet.add_argument("--prefill", type=int, default=0, help="prefill replicas")
    fleet.add_argument("--decode", type=int, default=0, help="decode replicas")
    fleet.add_argument("--prefill-layout", default="tp1")
    fleet.add_argument("--decode-layout", default="tp1")
    fleet.add_argument("--router", default="kv", help="kv, kv-approx, round-robin, random, least-loaded")
    fleet.add_argument("--disagg-threshold", type=int, default=256, help="uncached tokens from which prefill goes remote")
    fleet.add_argument("--prefill-queue-limit", type=int, default=8,
                       help="prefill on the decode replica while every prefill replica has this many in flight")
    fleet.add_argument("--local-prefill-limit", type=int, default=1,
                       help="... and while the decode replica prefills fewer than this many itself (0: never)")
    fleet.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    fleet.add_argument("--max-num-seqs", type=int, default=256)
    fleet.add_argument("--max-num-batched-tokens", type=int, default=8192)
    fleet.add_argument("--kv-blocks", type=int, default=None, help="per replica (default: what its memory holds)")
    fleet.add_argument("--replica-startup-s", type=float, default=60.0)
    fleet.add_argument("--change", action="append", default=[], metavar="AT_S:ACTION:ROLE[:COUNT[:TO_ROLE]]",
                       help="a fleet change, e.g. 600:add:decode:2, 900:remove:agg, 1200:rerole:prefill:1:decode")
    out = p.add_argument_group("targets and output")
    out.add_argument("--ttft-ms", type=float, default=2000.0)
    out.add_argument("--itl-ms", type=float, default=50.0)
    out.add_argument("--usd-per-gpu-hour", type=float, default=DEFAULT_USD_PER_GPU_HOUR)
    out.add_argument("--power-cap-kw", type=float, default=None, help="never provision more than this")
    out.add_argument("--interval-s", type=float, default=60.0, help="per-interval statistics period")
    out.add_argument("--seed", type=int, default=0)
    out.add_argument("--json", dest="json_out", type=Path, default=None)
    out.add_argument("--plot", type=Path, default=None, help="TTFT/ITL over time and their distribution (PNG)")
    out.add_argument("--no-requests", action="store_true", help="leave the per-request list out of the JSON")


def parse_change(text: str) -> FleetChange:
    parts = text.split(":")
    if not 3 <= len(parts) <= 5:
        raise ValueError(f"--change {text!r}: expected AT_S:ACTION:ROLE[:COUNT[:TO_ROLE]]")
    try:
        at_s, count = float(parts[0]), int(parts[3]) if len(parts) > 3 else 1
    except ValueError as exc:
        raise ValueError(f"--change {text!r}: AT_S must be a number and COUNT an integer") from exc
    return FleetChange(at_s, parts[1], parts[2], count, parts[4] if len(parts) > 4 else None)


def build_config(args: argparse.Namespace) -> FleetConfig:
    def profile(layout: str, flag: str) -> Profile:
        return Profile(args.model, args.gpu, args.precision, backend=args.backend, **parse_layout(layout, flag))

    return FleetConfig(
        profiles={"agg": profile(args.layout, "--layout"), "prefill": profile(args.prefill_layout, "--prefill-layout"),
                  "decode": profile(args.decode_layout, "--decode-layout")},
        agg=args.agg, prefill=args.prefill, decode=args.decode, router=args.router, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, kv_blocks=args.kv_blocks,
        disagg=DisaggConfig(args.disagg_threshold, args.prefill_queue_limit, args.local_prefill_limit), replica_startup_s=args.replica_startup_s,
        changes=tuple(parse_change(c) for c in args.change), sla=SLA(args.ttft_ms / 1e3, args.itl_ms / 1e3),
        usd_per_gpu_hour=args.usd_per_gpu_hour, power_cap_kw=args.power_cap_kw, interval_s=args.interval_s,
        seed=args.seed)


def load_requests(args: argparse.Namespace) -> list[TraceRequest]:
    if (args.trace is None) == (args.synthetic is None):
        raise ValueError("--trace: give a trace file or --synthetic KIND (one of them)")
    if args.trace is not None:
        return load_trace(args.trace, block_size=args.block_size, tokens_per_hash_block=args.tokens_per_hash_block,
                          time_scale=args.time_scale, max_requests=args.max_requests,
                          max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
                          rate_scale=args.rate_scale, seed=args.seed)
    return synthetic(args.synthetic, rate=args.rate * args.rate_scale, duration_s=args.duration_s,
                     input_tokens=args.isl, output_tokens=args.osl, cv=args.cv, period_s=args.period_s,
                     peak_to_trough=args.peak_to_trough, block_size=args.block_size, seed=args.seed)


def fleet_cmd(args: argparse.Namespace) -> int:
    config = build_config(args)
    check_outputs(args)
    requests = load_requests(args)
    result = _run_with_progress(config, requests)
    try:
        if args.plot:
            from tokenmill.sim.fleet.plots import plot_fleet

            plot_fleet(result, args.plot)
        if args.json_out:
            write_json_atomically(result.to_json(per_request=not args.no_requests), args.json_out)
    except OSError as exc:
        raise ValueError(f"--json/--plot: cannot write ({exc})") from exc
    print_totals(result)
    return 0


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written before spending the run on it."""
    for flag, path in (("--json", args.json_out), ("--plot", args.plot)):
        if path is None:
            continue
        if path.is_dir():
            raise ValueError(f"{flag} {path}: is a directory")
        parent = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ValueError(f"{flag} {path}: its directory cannot be written")
    if args.plot is not None and args.plot.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ValueError(f"--plot {args.plot}: must end in .png, .svg or .pdf")


def _run_with_progress(config: FleetConfig, requests: list[TraceRequest]) -> FleetResult:
    if len(requests) < PROGRESS_MIN_REQUESTS:
        return run_fleet(config, requests)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("simulating", total=len(requests))
        step = max(len(requests) // 200, 1)
        return run_fleet(config, requests, lambda done: bar.update(task, completed=done) if done % step == 0 else None)


def write_json_atomically(obj: object, path: Path) -> None:
    """Write the whole file or nothing: a temporary file beside it, renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def print_totals(result: FleetResult) -> None:
    from rich.console import Console
    from rich.table import Table

    t = result.totals
    config = result.config
    pools = ([f"{config.agg}x {config.profiles['agg'].describe()}"] if config.agg else []) + [
        f"{getattr(config, role)}x {role} {config.profiles[role].describe()}"
        for role in ("prefill", "decode") if getattr(config, role)]
    table = Table(title="fleet: " + ", ".join(pools) + f", router {config.router}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("requests (finished / rejected)", f"{t['finished']:,} / {t['rejected']:,}"),
            ("simulated duration", f"{t['duration_s']:.1f} s"),
            ("TTFT p50 / p90 / p99", _ms(t, "ttft_s")), ("mean ITL p50 / p90 / p99", _ms(t, "itl_mean_s")),
            ("max ITL p50 / p90 / p99", _ms(t, "itl_max_s")), ("cached prompt tokens", f"{t['cached_fraction']:.1%}"),
            ("SLA attainment", f"{t['sla_attainment']:.1%}"), ("goodput", f"{t['goodput_requests_per_s']:.2f} req/s"),
            ("output tokens/s", f"{t['output_tokens_per_s']:,.0f}"), ("GPU-hours (peak GPUs)", f"{t['gpu_hours']:.2f} ({t['peak_gpus']})"),
            ("$ per million output tokens", _num(t["usd_per_million_output_tokens"], ".3f")),
            ("energy", f"{t['energy_kwh']:.2f} kWh, {_num(t['joules_per_output_token'], '.2f')} J/token")]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _ms(t: dict, prefix: str) -> str:
    return " / ".join(_num(None if t[f"{prefix}_p{q}"] is None else t[f"{prefix}_p{q}"] * 1e3, ".1f")
                      for q in (50, 90, 99)) + " ms"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)
