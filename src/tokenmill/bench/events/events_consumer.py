"""The frontend side of `tokenmill bench events`: the frontend's own code, timed.

Each synthetic worker gets a `WorkerConnection`, as `WorkerPool` makes one: a SUB socket read
by `SocketReader` (ZeroMQ) or a subscription on the frontend's `NatsEventPlane` (NATS), frames
decoded and applied to a kv `Router`'s `KVIndexer` by `WorkerConnection._on_events`. The only
additions: the router notes when (CLOCK_MONOTONIC) it applied each event id, and a connection
notes that a frame arrived (the bench's probes, empty kv_events frames, apply nothing).

No worker listens on the connections' request addresses: a gap's snapshot request goes
nowhere. Between phases the bench applies the snapshot a worker would answer (`resync`).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import zmq

from tokenmill.fleet.worker_pool import WorkerConnection
from tokenmill.kv.events import KVEvent
from tokenmill.router.indexer import ApplyStatus, KVIndexer
from tokenmill.router.policies import Router, RouterConfig
from tokenmill.runtime.discovery import WorkerInfo

NOT_APPLIED = (ApplyStatus.STALE, ApplyStatus.IGNORED)


@dataclass(slots=True)
class PhaseResult:
    phase: str
    offered_rate: float  # events/s asked of all publishers together; 0: as fast as they go
    events: int  # emitted by the workers
    applied: int  # of those, applied to the index
    lost: int
    gaps: int  # id jumps the index detected
    index_mismatches: int  # workers whose indexed blocks differ from what they hold, before resync
    removed_events: int  # of `events`, evictions
    index_blocks: int  # (worker, tier, block) entries in the index at the end, before resync
    held_blocks: int  # blocks the workers hold then: stored minus removed
    nats_dropped_frames: int  # frames the workers' NATS client dropped (not connected, publish error)
    seconds: float  # first emit to last apply
    events_per_s: float  # applied / seconds
    p50_ms: float
    p99_ms: float
    max_ms: float
    # CPU per event emitted, first command to last apply; other_cpu_s: the rest of the host's busy time
    consumer_cpu_us: float = 0.0
    publishers_cpu_us: float = 0.0
    nats_server_cpu_us: float = 0.0
    other_cpu_s: float = 0.0


class TimedRouter(Router):
    """A kv `Router` that notes, per worker, each event id it applied and when."""

    def __init__(self) -> None:
        super().__init__(RouterConfig(policy="kv"))
        self.applied: dict[str, tuple[list[int], list[int]]] = {}

    @property
    def index(self) -> KVIndexer:
        if self.indexer is None:
            raise RuntimeError("a kv router always has an indexer")
        return self.indexer

    def add_worker(self, worker: str) -> None:
        super().add_worker(worker)
        self.applied[worker] = ([], [])

    def apply_event(self, event: KVEvent) -> ApplyStatus:
        status = super().apply_event(event)
        if status not in NOT_APPLIED:
            ids, times = self.applied[event.worker]
            ids.append(event.event_id)
            times.append(time.monotonic_ns())
        return status


class ProbedConnection(WorkerConnection):
    """Notes any frame, the bench's empty probes included: a subscription that got one is live."""

    heard = False

    def _on_events(self, frames: list[bytes]) -> None:
        self.heard = True
        super()._on_events(frames)


class EventConsumer:
    def __init__(self, request_dir: str, plane: Any = None) -> None:
        self.router = TimedRouter()
        self.request_dir, self.plane = request_dir, plane
        self.ctx = zmq.Context()
        self.connections: list[ProbedConnection] = []

    def connect(self, endpoints: dict[str, str]) -> None:
        """Must run on the loop: a connection reads its socket there."""
        key = "events_subject" if self.plane is not None else "events_address"
        for worker, endpoint in endpoints.items():
            info = WorkerInfo(worker, f"ipc://{self.request_dir}/{worker}-requests.sock", metadata={key: endpoint})
            self.router.add_worker(worker)
            self.connections.append(ProbedConnection(info, self.ctx, self.router, self.plane))

    def all_heard(self) -> bool:
        return all(conn.heard for conn in self.connections)

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
        self.ctx.destroy(linger=0)

    def marks(self) -> dict[str, int]:
        return {worker: len(ids) for worker, (ids, _) in self.router.applied.items()}

    async def settle(self, expected: int, since: int, quiet_s: float) -> None:
        """Until `expected` events were applied after `since` (events_applied), or none for `quiet_s`."""
        index = self.router.index
        last, last_change = index.events_applied, time.monotonic()
        while index.events_applied - since < expected and time.monotonic() - last_change < quiet_s:
            await asyncio.sleep(0.01)
            if index.events_applied != last:
                last, last_change = index.events_applied, time.monotonic()

    def mismatches(self, held: dict[str, list[int]]) -> list[str]:
        indexed = self.router.index.blocks_by_worker()
        return [w for w, blocks in held.items() if set(indexed.get(w, {}).get("device", ())) != set(blocks)]

    def resync(self, workers: dict[str, dict[str, Any]], stale: list[str]) -> None:
        """The snapshot each of `stale` would send when asked (its blocks at its last event id)."""
        for worker in stale:
            result = workers[worker]
            last_id = result["first_id"] + len(result["stamps"]) - 1
            self.router.apply_snapshot(worker, {"device": result["held"]}, last_id)


def summarize(phase: str, rate: float, consumer: EventConsumer, marks: dict[str, int], gaps_before: int,
              replies: list[dict[str, Any]]) -> tuple[PhaseResult, list[str]]:
    """The phase's figures, and the workers whose indexed blocks differ from what they hold."""
    workers = {name: result for reply in replies for name, result in reply["workers"].items()}
    latencies, last_apply = _latencies_ns(consumer.router, workers, marks)
    first_emit = min((r["stamps"][0] for r in workers.values() if r["stamps"]), default=last_apply)
    seconds = max(last_apply - first_emit, 1) / 1e9
    events = sum(len(r["stamps"]) for r in workers.values())
    stale = consumer.mismatches({name: r["held"] for name, r in workers.items()})
    result = PhaseResult(
        phase, rate, events, applied=len(latencies), lost=events - len(latencies),
        gaps=consumer.router.index.gaps_detected - gaps_before, index_mismatches=len(stale),
        removed_events=sum(r["removed"] for r in workers.values()), index_blocks=consumer.router.index.num_blocks(),
        held_blocks=sum(len(r["held"]) for r in workers.values()),
        nats_dropped_frames=sum(int(r.get("dropped_frames", 0)) for r in replies), seconds=seconds,
        events_per_s=len(latencies) / seconds, p50_ms=_quantile_ms(latencies, 0.50),
        p99_ms=_quantile_ms(latencies, 0.99), max_ms=_quantile_ms(latencies, 1.0))
    return result, stale


def _latencies_ns(router: TimedRouter, workers: dict[str, dict[str, Any]],
                  marks: dict[str, int]) -> tuple[list[int], int]:
    """Sorted apply-minus-emit times of the phase's events, and the last apply time."""
    latencies, last_apply = [], 0
    for name, result in workers.items():
        ids, times = router.applied[name]
        first, stamps = result["first_id"], result["stamps"]
        for event_id, applied_at in zip(ids[marks[name]:], times[marks[name]:]):
            if 0 <= event_id - first < len(stamps):
                latencies.append(applied_at - stamps[event_id - first])
                last_apply = max(last_apply, applied_at)
    latencies.sort()
    return latencies, last_apply


def _quantile_ms(ordered_ns: list[int], q: float) -> float:
    if not ordered_ns:
        return 0.0
    return ordered_ns[min(len(ordered_ns) - 1, int(q * len(ordered_ns)))] / 1e6
