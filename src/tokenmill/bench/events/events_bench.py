"""`tokenmill bench events`: KV events through NATS and the embedded ZeroMQ path, into the index.

`--workers` synthetic workers in `--publisher-procs` child processes (`events_publishers`) publish
KV events with the worker's own emitter and publisher: a ZeroMQ PUB socket each on ipc://, or a
subject each on one NATS connection per process. One consumer here (`events_consumer`) reads them
with the frontend's own connections and applies every event to a kv `Router`'s index. Per
transport, two phases on the same workers and index (event ids run on):

1. throughput: each worker emits `--events` as fast as its process steps it. events/s = events
   applied / (first emit -> last apply); lost = emitted - applied (a ZeroMQ PUB socket drops at its
   high-water mark); gaps = id jumps the index detected.
2. latency: `--rate` events/s in all, for `--latency-s`. Event-to-index latency = apply time - emit
   time, both CLOCK_MONOTONIC, which every process on a Linux host shares.

After each phase the index is compared with what every worker holds (stored minus removed); a
worker that differs gets the snapshot it would send when asked. CPU per event of the consumer,
the publishers and nats-server, and what the rest of the host used meanwhile, come from /proc
(`events_transport`). The bench starts its own nats-server (from PATH) on a free 127.0.0.1 port
and stops it. Publishers, nats-server and the consumer share the host's cores: the figures are
the whole path's on that host, read next to the CPU figures.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # zmq, nats and the frontend: imported by `run` only
    from tokenmill.bench.events.events_transport import TransportResult

log = logging.getLogger(__name__)

TRANSPORTS = ("nats", "zmq")
SERVER_START_S = 20.0


@dataclass(slots=True)
class NatsServer:
    url: str
    pid: int


@dataclass(slots=True)
class EventsBenchReport:
    workers: int
    publisher_procs: int
    events_per_worker: int
    rate: float
    latency_s: float
    pool_blocks: int
    host_cpus: int
    transports: list[TransportResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__ if name != "transports"}
        out["transports"] = {t.transport: {"throughput": asdict(t.throughput), "latency": asdict(t.latency)}
                             for t in self.transports}
        return {"schema": "tokenmill.bench.events", **out}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=64, help="synthetic workers, each its own socket or subject")
    parser.add_argument("--publisher-procs", type=int, default=4, help="child processes the workers are spread over")
    parser.add_argument("--events", type=int, default=2000, help="events per worker in the throughput phase")
    parser.add_argument("--rate", type=float, default=10_000,
                        help="events/s from all workers together in the latency phase: ~160 a worker, one decoding "
                             "~1.2k tok/s stores a 16-token block 78 times a second, each after an eviction")
    parser.add_argument("--latency-s", type=float, default=5.0, help="length of the latency phase")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma separated: nats, zmq")
    parser.add_argument("--pool-blocks", type=int, default=512, help="device blocks per worker (then evictions)")
    parser.add_argument("--prompt-blocks", type=int, default=64)
    parser.add_argument("--chunk-blocks", type=int, default=32, help="blocks stored per prefill step")
    parser.add_argument("--output-blocks", type=int, default=16, help="decode blocks per request")
    parser.add_argument("--prefixes", type=int, default=64, help="distinct shared prefixes")
    parser.add_argument("--quiet-s", type=float, default=3.0, help="a phase ends this long after the last apply")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None, help="write the report here")


def run(args: argparse.Namespace) -> int:
    from tokenmill.runtime import event_loop

    transports = [t.strip() for t in str(args.transports).split(",") if t.strip()]
    if not transports or set(transports) - set(TRANSPORTS):
        raise ValueError(f"--transports must name some of {', '.join(TRANSPORTS)}, got {args.transports!r}")
    for name in ("workers", "publisher_procs", "events", "rate", "latency_s", "pool_blocks", "prompt_blocks",
                 "chunk_blocks", "output_blocks", "prefixes", "quiet_s"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.publisher_procs > args.workers or args.pool_blocks < args.prompt_blocks + args.output_blocks:
        raise ValueError("need --publisher-procs <= --workers and --pool-blocks >= --prompt-blocks + --output-blocks")
    report = event_loop.run(measure(args, transports))
    render_table(report)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0


async def measure(args: argparse.Namespace, transports: list[str]) -> EventsBenchReport:
    from tokenmill.bench.events.events_transport import measure_transport

    report = EventsBenchReport(args.workers, args.publisher_procs, args.events, args.rate, args.latency_s,
                               args.pool_blocks, os.cpu_count() or 1)
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="tokenmill-events-"))
        nats = stack.enter_context(nats_server()) if "nats" in transports else None
        for transport in transports:
            log.info("%s: %d workers in %d processes", transport, args.workers, args.publisher_procs)
            report.transports.append(await measure_transport(
                transport, args, Path(tmp) / transport, nats.url if nats else "", nats.pid if nats else None))
    return report


@contextmanager
def nats_server() -> Iterator[NatsServer]:
    """A nats-server on a free 127.0.0.1 port, stopped by its pid on exit."""
    from tokenmill.bench.harness.serve_process import HOST, free_port

    binary = shutil.which("nats-server")
    if binary is None:
        raise RuntimeError("nats-server is not on PATH (Debian: apt-get install nats-server)")
    port = free_port()
    process = subprocess.Popen([binary, "-a", HOST, "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not _greets(HOST, port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not come up on {HOST}:{port}")
            time.sleep(0.05)
        yield NatsServer(f"nats://{HOST}:{port}", process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _greets(host: str, port: int) -> bool:
    try:  # the server greets every client with INFO {...}
        with socket.create_connection((host, port), timeout=0.5) as sock:
            return sock.recv(4) == b"INFO"
    except OSError:
        return False


def render_table(report: EventsBenchReport) -> None:
    from rich.console import Console
    from rich.table import Table

    cpu = ", ".join(f"{t.transport} {t.throughput.consumer_cpu_us:.1f} us" for t in report.transports)
    other = ", ".join(f"{t.transport} {t.latency.other_cpu_s:.1f}" for t in report.transports)
    gaps = sum(t.throughput.gaps + t.latency.gaps for t in report.transports)
    table = Table(title=f"tokenmill bench events — {report.workers} workers in {report.publisher_procs} processes, "
                        f"{report.host_cpus} CPUs",
                  caption=f"max: {report.events_per_worker} events per worker, as fast as they go; at rate: "
                          f"{report.rate:,.0f} events/s for {report.latency_s:g} s, latency emit -> applied in the "
                          f"index; lost: both phases; id gaps seen: {gaps}; consumer CPU per event at max: {cpu}; "
                          f"other processes' CPU s at rate: {other}")
    for column in ("transport", "max ev/s", "at rate ev/s", "p50 ms", "p99 ms", "max ms", "lost"):
        table.add_column(column, justify="left" if column == "transport" else "right")
    for t in report.transports:
        tp, lat = t.throughput, t.latency
        table.add_row(t.transport, f"{tp.events_per_s:,.0f}", f"{lat.events_per_s:,.0f}", f"{lat.p50_ms:.2f}",
                      f"{lat.p99_ms:.2f}", f"{lat.max_ms:.2f}", f"{tp.lost + lat.lost:,}")
    Console().print(table)
