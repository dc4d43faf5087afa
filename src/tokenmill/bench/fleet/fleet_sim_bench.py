"""`tokenmill bench fleet-sim`: how fast the fleet simulator replays a whole trace on one core.

It first finds the fleet the trace *needs*: the fewest replicas whose SLA attainment reaches
`--attainment` (bisection over replica counts, each probe a full replay), then times the
replay at that size `--repeats` times and reports the best wall time, requests and events
(steps, arrivals, transfers) simulated per second. The process is pinned to one core, as the
simulator is single-threaded and the machine may be shared.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.datasets import AZURE_CONV_TRACE, data_dir

log = logging.getLogger(__name__)
SCHEMA = "tokenmill.bench.fleet_sim/1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=str(data_dir() / AZURE_CONV_TRACE), help="default: the Azure 2023 conv trace")
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--model", default="llama-3.1-405b")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--precision", default="fp8")
    parser.add_argument("--layout", default="tp8")
    parser.add_argument("--router", default="kv")
    parser.add_argument("--ttft-ms", type=float, default=2000.0)
    parser.add_argument("--itl-ms", type=float, default=40.0)
    parser.add_argument("--attainment", type=float, default=0.99, help="SLA attainment the needed fleet reaches")
    parser.add_argument("--max-replicas", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed replays at the needed size (best is reported)")
    parser.add_argument("--json", dest="json_out", type=Path, default=None)


def _replay(args: argparse.Namespace, requests: list, replicas: int) -> tuple[Any, float, int]:
    from tokenmill.sim.fleet.clock import Profile, parse_layout
    from tokenmill.sim.fleet.config import SLA, FleetConfig
    from tokenmill.sim.fleet.fleet import FleetSim
    from tokenmill.sim.fleet.report import summarize

    profile = Profile(args.model, args.gpu, args.precision, **parse_layout(args.layout))
    config = FleetConfig(profiles={"agg": profile}, agg=replicas, router=args.router,
                         sla=SLA(args.ttft_ms / 1e3, args.itl_ms / 1e3))
    started = time.perf_counter()
    sim = FleetSim(config)
    sim.run(requests)
    seconds = time.perf_counter() - started
    return summarize(sim), seconds, sim.events_processed


def _needed_replicas(args: argparse.Namespace, requests: list) -> tuple[int, dict[int, float]]:
    """Fewest replicas reaching the attainment target (attainment grows with replicas)."""
    probes: dict[int, float] = {}

    def attains(n: int) -> bool:
        probes[n] = float(_replay(args, requests, n)[0].totals["sla_attainment"])
        log.info("fleet-sim: %d replicas -> SLA attainment %.2f%%", n, 100 * probes[n])
        return probes[n] >= args.attainment

    lo, hi = 0, 1
    while not attains(hi):
        if hi >= args.max_replicas:
            raise ValueError(f"--max-replicas: {args.max_replicas} replicas do not reach {args.attainment:.0%}")
        lo, hi = hi, min(hi * 2, args.max_replicas)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if attains(mid) else (mid, hi)
    return hi, probes


def run(args: argparse.Namespace) -> int:
    from tokenmill.sim.fleet.arrivals import load_trace
    from tokenmill.sim.fleet.clock import parse_layout

    parse_layout(args.layout, "--layout")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    started = time.perf_counter()
    requests = load_trace(args.trace, rate_scale=args.rate_scale)
    load_s = time.perf_counter() - started
    replicas, probes = _needed_replicas(args, requests)
    timings = [_replay(args, requests, replicas) for _ in range(max(args.repeats, 1))]
    result, seconds, events = min(timings, key=lambda t: t[1])
    gpus_per_replica = result.config.profiles["agg"].gpus
    report = {"schema": SCHEMA, "trace": Path(args.trace).name, "rate_scale": args.rate_scale,
              "requests": len(requests), "deployment": f"{args.model}@{args.gpu}:{args.precision}:{args.layout}",
              "needed_replicas": replicas, "needed_gpus": replicas * gpus_per_replica,
              "attainment_target": args.attainment, "probes": {str(k): v for k, v in sorted(probes.items())},
              "trace_load_s": load_s, "replay_s": seconds, "replay_s_all": [t[1] for t in timings],
              "requests_per_s": len(requests) / seconds, "events": events, "events_per_s": events / seconds,
              "simulated_s": result.totals["duration_s"], "totals": result.totals}
    _print(report)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _print(report: dict[str, Any]) -> None:
    table = Table(title=f"fleet simulator: {report['trace']} x{report['rate_scale']:g}, {report['deployment']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    t = report["totals"]
    for name, value in (
            ("requests", f"{report['requests']:,}"), ("simulated time", f"{report['simulated_s']:,.0f} s"),
            ("fleet it needs (attainment >= target)", f"{report['needed_replicas']} replicas = {report['needed_gpus']} GPUs"),
            ("SLA attainment there", f"{t['sla_attainment']:.2%}"),
            ("replay wall time, one core (best)", f"{report['replay_s']:.2f} s"),
            ("requests simulated / s", f"{report['requests_per_s']:,.0f}"),
            ("events simulated / s", f"{report['events_per_s']:,.0f}"), ("trace load", f"{report['trace_load_s']:.2f} s")):
        table.add_row(name, value)
    Console().print(table)
