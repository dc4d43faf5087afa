"""One transport's run for `tokenmill bench events`: publisher processes, the consumer, two phases.

The publishers start, the consumer connects to every worker's socket or subject and probes until
each is live, then the throughput phase (as fast as the workers go) and the latency phase (paced
to `--rate`) run on the same workers and index. CPU is read from /proc around each phase: the
consumer (this process), the publishers, nats-server, and what the rest of the host used.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack

from tokenmill.bench.events.events_consumer import EventConsumer, PhaseResult, summarize
from tokenmill.bench.events.events_publishers import PublisherSpec, child_main

log = logging.getLogger(__name__)

START_TIMEOUT_S = 20.0


@dataclass(slots=True)
class TransportResult:
    transport: str
    throughput: PhaseResult
    latency: PhaseResult


@dataclass(slots=True)
class CpuMeter:
    roles: dict[str, list[int]]  # role -> pids

    def read(self) -> dict[str, float]:
        from tokenmill.bench.harness.serve_observe import cpu_seconds, host_busy_seconds

        used = {role: sum(cpu_seconds(pid) or 0.0 for pid in pids) for role, pids in self.roles.items()}
        return {**used, "host": host_busy_seconds() or 0.0}

    @staticmethod
    def charge(result: PhaseResult, before: dict[str, float], after: dict[str, float]) -> None:
        used = {role: after[role] - before[role] for role in before}
        per_event = 1e6 / max(result.events, 1)
        result.consumer_cpu_us = used["consumer"] * per_event
        result.publishers_cpu_us = used["publishers"] * per_event
        result.nats_server_cpu_us = used["nats_server"] * per_event
        # clamped: per-process and host-wide tick counts are sampled apart, a few ticks either way
        result.other_cpu_s = max(0.0, used["host"] - used["consumer"] - used["publishers"] - used["nats_server"])


class PublisherProcess:
    """Parent-side handle on one child: `start()`, `ready()` (its endpoints), then `call()` commands."""

    def __init__(self, spec: PublisherSpec) -> None:
        self.spec = spec
        context = multiprocessing.get_context("spawn")  # no fork: the parent holds a loop and threads
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=child_main, args=(child_conn, msgpack.packb(asdict(spec))),
                                        name=f"bench-events-publishers-{spec.index}", daemon=True)

    def start(self) -> None:
        self._process.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def ready(self, timeout: float = 60.0) -> dict[str, str]:
        return self._receive(timeout)["endpoints"]

    def call(self, op: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        self._conn.send_bytes(msgpack.packb({"op": op, **args}))
        return self._receive(timeout)

    async def call_async(self, op: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        return await asyncio.to_thread(self.call, op, timeout, **args)

    def _receive(self, timeout: float) -> dict[str, Any]:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"publisher process {self.spec.index} did not answer within {timeout} s")
        reply = msgpack.unpackb(self._conn.recv_bytes(), raw=False)
        if "error" in reply:
            raise RuntimeError(f"publisher process {self.spec.index}: {reply['error']}")
        return reply

    def stop(self) -> None:
        """Ask it to stop; kill it (by its pid) if it does not within a few seconds."""
        if self._process.pid is None:  # never started
            self._conn.close()
            return
        if self._process.is_alive():
            try:
                self.call("stop", timeout=10)
            except (OSError, EOFError, TimeoutError, RuntimeError) as exc:
                log.warning("publisher process %d did not stop cleanly: %s", self.spec.index, exc)
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)
        self._conn.close()


async def measure_transport(transport: str, args: argparse.Namespace, ipc_dir: Path, nats_url: str = "",
                            nats_pid: int | None = None) -> TransportResult:
    ipc_dir.mkdir(parents=True)
    procs = [PublisherProcess(spec) for spec in _specs(transport, args, str(ipc_dir), nats_url)]
    plane, consumer = None, None
    try:
        for proc in procs:
            proc.start()
        endpoints = [await asyncio.to_thread(proc.ready) for proc in procs]
        plane = await _frontend_plane(nats_url) if transport == "nats" else None
        consumer = EventConsumer(str(ipc_dir), plane)
        for found in endpoints:
            consumer.connect(found)
        await _until_subscribed(procs, consumer)
        meter = CpuMeter({"consumer": [os.getpid()], "publishers": [int(proc.pid or 0) for proc in procs],
                          "nats_server": [nats_pid] if transport == "nats" and nats_pid else []})
        throughput = await _phase("throughput", procs, consumer, meter, args.events, 0.0, args)
        per_worker = max(1, math.ceil(args.rate * args.latency_s / args.workers))
        latency = await _phase("latency", procs, consumer, meter, per_worker, args.rate, args)
        return TransportResult(transport, throughput, latency)
    finally:
        for proc in procs:
            proc.stop()
        if consumer is not None:
            consumer.close()
        if plane is not None:
            await plane.close()


def _specs(transport: str, args: argparse.Namespace, ipc_dir: str, nats_url: str) -> list[PublisherSpec]:
    names = [f"worker-{i}" for i in range(args.workers)]
    return [PublisherSpec(index, names[index::args.publisher_procs], transport, ipc_dir, nats_url, "bench",
                          args.pool_blocks, args.prompt_blocks, args.chunk_blocks, args.output_blocks,
                          args.prefixes, args.seed)
            for index in range(args.publisher_procs)]


async def _frontend_plane(url: str) -> Any:
    from tokenmill.runtime.event_plane import NatsEventPlane

    plane = NatsEventPlane([url], "bench-frontend")
    await plane.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not plane.connected:
        if time.monotonic() > deadline:
            await plane.close()
            raise RuntimeError(f"the frontend's NATS connection to {url} did not come up")
        await asyncio.sleep(0.01)
    return plane


async def _until_subscribed(procs: list[PublisherProcess], consumer: EventConsumer) -> None:
    """Probe until every connection heard its worker: a SUB socket or a NATS subscription gets
    nothing sent before it is in place, and the index must see every id from 0."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not consumer.all_heard():
        if time.monotonic() > deadline:
            raise RuntimeError("the consumer's subscriptions did not come up")
        await asyncio.gather(*(proc.call_async("probe") for proc in procs))
        await asyncio.sleep(0.05)


async def _phase(name: str, procs: list[PublisherProcess], consumer: EventConsumer, meter: CpuMeter, events: int,
                 rate: float, args: argparse.Namespace) -> PhaseResult:
    index = consumer.router.index
    marks, gaps, since, cpu = consumer.marks(), index.gaps_detected, index.events_applied, meter.read()
    timeout = 60.0 + (2 * events * args.workers / rate if rate else 0.0)
    replies = await asyncio.gather(*(
        proc.call_async("run", timeout, events=events, rate=rate * len(proc.spec.workers) / args.workers)
        for proc in procs))
    emitted = sum(len(r["stamps"]) for reply in replies for r in reply["workers"].values())
    await consumer.settle(emitted, since, args.quiet_s)
    cpu_after = meter.read()
    result, stale = summarize(name, rate, consumer, marks, gaps, replies)
    meter.charge(result, cpu, cpu_after)
    consumer.resync({w: r for reply in replies for w, r in reply["workers"].items()},
                    sorted(set(stale) | set(index.awaiting_snapshot())))
    log.info("%s %s: %d events, %d applied (%.0f/s), %d lost, p50 %.2f ms, p99 %.2f ms; CPU us/event: consumer "
             "%.1f, publishers %.1f, nats-server %.1f; the rest of the host: %.1f CPU s", name, procs[0].spec.transport,
             result.events, result.applied, result.events_per_s, result.lost, result.p50_ms, result.p99_ms,
             result.consumer_cpu_us, result.publishers_cpu_us, result.nats_server_cpu_us, result.other_cpu_s)
    return result
