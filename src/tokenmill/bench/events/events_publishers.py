"""Synthetic workers for `tokenmill bench events`, publishing KV events from a child process.

A worker here is a real `KVEventEmitter` feeding a real `KVEventPublisher` (its own ZeroMQ PUB
socket on ipc://, or its subject on the process's one NATS connection), on a uvloop loop as in a
worker process, so the frames on the wire are a tokenmill worker's. Only the engine is played,
by `CacheScript`, on the loop thread as the mock runner's engine steps. Each event's emit time
(CLOCK_MONOTONIC, one clock for every process on the host) is noted out of band.

The parent (`events_transport.PublisherProcess`) drives a child over a pipe, one msgpack map at a
time (never pickle):

    (ready)                -> {endpoints: {worker: ZeroMQ address or NATS subject}}
    probe                  -> {}  one empty kv_events frame per worker (nothing to apply)
    run {events, rate}     -> {workers: {worker: {first_id, stamps, held, removed}}, dropped_frames}
    stop                   -> {}
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import msgpack

from tokenmill.bench.harness.router_workload import ChainFactory
from tokenmill.kv.events import KVEvent, KVEventEmitter

log = logging.getLogger(__name__)

PACE_S = 0.001


@dataclass(slots=True)
class PublisherSpec:
    index: int
    workers: list[str]
    transport: str  # "zmq" or "nats"
    ipc_dir: str
    nats_url: str
    model: str
    pool_blocks: int
    prompt_blocks: int
    chunk_blocks: int
    output_blocks: int
    prefixes: int
    seed: int


class CacheScript:
    """One worker's device pool serving one request after another, an engine step at a time.

    A request is a popular prefix cut at a random depth plus a unique tail (`ChainFactory`), then
    `output_blocks` decode blocks. Its leading blocks the pool holds are a cache hit; the rest are
    stored a prefill chunk per step, then a block per decode step. A full pool first evicts its
    least recently used blocks: a removed event, then the stored one (`BlockPool.allocate`, then
    `cache_blocks`).
    """

    def __init__(self, chains: ChainFactory, spec: PublisherSpec) -> None:
        self.chains, self.spec = chains, spec
        self.held: dict[int, None] = {}  # least recently used first
        self.removed_events = 0
        self._plan: list[tuple[int | None, list[int]]] = []  # (parent, blocks) per step, popped from the end

    def step(self, emitter: KVEventEmitter) -> None:
        if not self._plan:
            self._plan = self._next_request()
        parent, blocks = self._plan.pop()
        excess = len(self.held) + len(blocks) - self.spec.pool_blocks
        if excess > 0:
            gone = list(itertools.islice(self.held, excess))
            for block in gone:
                del self.held[block]
            emitter.removed("device", gone)
            self.removed_events += 1
        emitter.stored("device", parent, blocks)
        for block in blocks:
            self.held.pop(block, None)
            self.held[block] = None

    def _next_request(self) -> list[tuple[int | None, list[int]]]:
        prompt = self.chains.sequence(self.spec.prompt_blocks)
        hit = 0
        while hit < len(prompt) and prompt[hit] in self.held:
            del self.held[prompt[hit]]
            self.held[prompt[hit]] = None  # now the most recently used
            hit += 1
        chain = prompt + self.chains.extend(prompt[-1], self.spec.output_blocks)
        chunk = self.spec.chunk_blocks
        steps = [(chain[i - 1] if i else None, prompt[i:i + chunk]) for i in range(hit, len(prompt), chunk)]
        steps += [(chain[i - 1], [chain[i]]) for i in range(len(prompt), len(chain))]
        steps.reverse()
        return steps


class SyntheticWorker:
    def __init__(self, name: str, spec: PublisherSpec, plane: Any) -> None:
        from tokenmill.worker.kv_publisher import KVEventPublisher

        chains = ChainFactory(spec.prefixes, spec.prompt_blocks, spec.seed)  # the same prefixes on every worker
        chains.rng = random.Random(f"{spec.seed}/{name}")  # but tails of its own
        self.name, self.script = name, CacheScript(chains, spec)
        self.emitter = KVEventEmitter(name)
        self.stamps: list[int] = []
        self.first_id = self.target = self.removed_before = 0
        self.emitter.subscribe(self._stamp)  # before the publisher's: the clock starts as the engine emits
        # all the publisher reads of an engine adapter here: its `events`
        engine: Any = SimpleNamespace(events=self.emitter)
        if plane is not None:
            from tokenmill.runtime.event_plane import kv_subject

            self.endpoint = kv_subject(spec.model, name)
            self.publisher = KVEventPublisher(engine, name, plane=plane, subject=self.endpoint)
        else:
            self.publisher = KVEventPublisher(engine, name, f"ipc://{spec.ipc_dir}/{name}-events.sock")
            self.endpoint = str(self.publisher.address)
        self.publisher.start()

    @property
    def emitted(self) -> int:
        return self.emitter.last_event_id + 1

    def _stamp(self, event: KVEvent) -> None:
        self.stamps.append(time.monotonic_ns())

    def begin(self, events: int) -> None:
        self.first_id, self.stamps, self.target = self.emitted, [], self.emitted + events
        self.removed_before = self.script.removed_events

    def probe(self) -> None:
        import zmq

        from tokenmill.runtime import protocol as p

        frame = p.pack({"type": p.KV_EVENTS, "worker": self.name, "events": []})
        if self.publisher.plane is not None:
            self.publisher.plane.publish(str(self.endpoint), frame)
        else:
            self.publisher.socket.send(frame, flags=zmq.NOBLOCK)  # type: ignore[union-attr]

    def result(self) -> dict[str, Any]:
        return {"first_id": self.first_id, "stamps": self.stamps, "held": list(self.script.held),
                "removed": self.script.removed_events - self.removed_before}


async def publish(workers: list[SyntheticWorker], events: int, rate: float) -> None:
    """`events` more from each worker (the last step may add one): a step of every worker per loop
    turn as fast as they go (`rate` 0), or paced to `rate` events/s for them all."""
    for worker in workers:
        worker.begin(events)
    active, started, sent = deque(workers), time.monotonic(), 0
    while active:
        due = len(active) if rate <= 0 else int((time.monotonic() - started) * rate) - sent
        if due <= 0:
            await asyncio.sleep(PACE_S)
            continue
        while due > 0 and active:
            worker = active.popleft()
            before = worker.emitted
            worker.script.step(worker.emitter)
            sent += worker.emitted - before
            due -= worker.emitted - before
            if worker.emitted < worker.target:
                active.append(worker)
        # the publishers flush on the next turn: a frame per worker and step, as after an engine step
        await asyncio.sleep(PACE_S if rate > 0 else 0)


def child_main(conn: Connection, spec_bytes: bytes) -> None:
    from tokenmill.runtime import event_loop

    logging.basicConfig(level=logging.WARNING)
    event_loop.run(_serve(conn, PublisherSpec(**msgpack.unpackb(spec_bytes, raw=False))))


async def _serve(conn: Connection, spec: PublisherSpec) -> None:
    plane, workers = None, []
    try:
        if spec.transport == "nats":
            from tokenmill.runtime.event_plane import NatsEventPlane

            plane = NatsEventPlane([spec.nats_url], f"bench-publishers-{spec.index}")
            await plane.start()
            while not plane.connected:
                await asyncio.sleep(0.01)  # the parent's timeout bounds this
        workers = [SyntheticWorker(name, spec, plane) for name in spec.workers]
    except Exception as exc:  # the parent waits for an answer: give it the reason
        conn.send_bytes(msgpack.packb({"error": f"start-up failed: {type(exc).__name__}: {exc}"}))
        raise
    try:
        conn.send_bytes(msgpack.packb({"endpoints": {w.name: w.endpoint for w in workers}}))
        await _command_loop(conn, workers, plane)
    finally:
        for worker in workers:
            worker.publisher.close()
        if plane is not None:
            await plane.close()


async def _command_loop(conn: Connection, workers: list[SyntheticWorker], plane: Any) -> None:
    while True:
        request = msgpack.unpackb(await asyncio.to_thread(conn.recv_bytes), raw=False)
        op, reply = request.get("op"), {}
        try:
            if op == "stop":
                conn.send_bytes(msgpack.packb({}))
                return
            if op == "probe":
                for worker in workers:
                    worker.probe()
            elif op == "run":
                dropped = plane.dropped_frames if plane is not None else 0
                await publish(workers, int(request["events"]), float(request["rate"]))
                reply = {"workers": {w.name: w.result() for w in workers},
                         "dropped_frames": (plane.dropped_frames if plane is not None else 0) - dropped}
            else:
                raise ValueError(f"unknown command {op!r}")
        except Exception as exc:  # report to the parent instead of dying silently
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send_bytes(msgpack.packb(reply))
