"""The fleet simulator's discrete-event loop: arrivals → routing → replicas' steps → tokens.

Routing is the router package's own: one `Router` per pool (the aggregated pool, or the prefill
pool on `kv` and the decode pool on the configured policy, as `tokenmill serve` holds them), fed
by every simulated replica's KV events and charged and released exactly as the frontend does
(`select` at arrival, `on_first_token`, `on_finished`). Disaggregation decides with the
frontend's own `DisaggPolicy`: the decode replica is chosen first, and the prompt goes to a
prefill replica unless its uncached part is short or every prefill queue is full (and the decode
replica prefills fewer than the policy's local limit itself). A remotely
prefilled request's first token comes from the prefill replica; its KV (the blocks the decode
replica lacks) then crosses the link — NVLink when both instances fit in one NVLink domain,
the scale-out NIC otherwise — and the decode replica continues.

Events at equal times run in the order they were scheduled; the run is deterministic for a
seed (routers' tie-breaks draw from seeded generators).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import xxhash

from tokenmill.kv.events import KVEventEmitter
from tokenmill.router.decision import RoutingRequest
from tokenmill.router.disagg import LOCAL, REMOTE, DisaggPolicy
from tokenmill.router.policies import Router, RouterConfig
from tokenmill.sim.fleet.admission import FleetAdmission
from tokenmill.sim.fleet.cache import SeqBlocks
from tokenmill.sim.fleet.clock import StepClock
from tokenmill.sim.fleet.config import FleetChange, FleetConfig
from tokenmill.sim.fleet.records import ChangeRecord, IntervalRecord, RequestRecord
from tokenmill.sim.fleet.replica import Replica, Run
from tokenmill.sim.fleet.worker import SimSeq, SimWorker, WorkerConfig

if TYPE_CHECKING:
    from tokenmill.sim.fleet.arrivals import TraceRequest

log = logging.getLogger(__name__)

ARRIVE, STEP, PULLED, UP, CHANGE, TICK = range(6)


def _blocks_of(request: TraceRequest) -> SeqBlocks:
    """A fresh block table: the prompt's hashes, and a request-unique salt for generated blocks."""
    return SeqBlocks(list(request.block_hashes), xxhash.xxh3_64_intdigest(request.request_id.encode()))


class FleetSim:
    def __init__(self, config: FleetConfig, clocks: dict[str, StepClock] | None = None) -> None:
        self.config = config
        self.clocks = clocks or {role: StepClock(config.profiles[role]) for role in config.roles_used()}
        self.policy = DisaggPolicy(config.disagg)
        rngs = random.Random(config.seed)
        self.routers = {
            "agg": Router(RouterConfig(config.router, config.block_size), random.Random(rngs.random())),
            "prefill": Router(RouterConfig("kv", config.block_size), random.Random(rngs.random())),
            "decode": Router(RouterConfig(config.router, config.block_size), random.Random(rngs.random())),
        }
        self.serving_role = "decode" if config.disaggregated else "agg"  # the pool that streams tokens
        self.replicas: dict[str, Replica] = {}
        self.records: dict[str, RequestRecord] = {}
        self.intervals: list[IntervalRecord] = []
        self.change_log: list[ChangeRecord] = []
        self.prefill_in_flight: Counter[str] = Counter()
        self.local_prefills: Counter[str] = Counter()  # decode replica -> its own prefills before the first token
        self.backlog: deque[TraceRequest] = deque()  # arrived while no replica could take them
        self.admission = FleetAdmission(config.tenants, config.max_in_flight, config.batch_share)
        self.now = 0.0
        self._heap: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self._names = itertools.count()
        self._arrivals_in_interval = 0
        self._next_sample = config.interval_s
        self._capacity_tokens = {role: self._blocks(role) * config.block_size for role in self.clocks}
        self.finished = 0
        self.events_processed = 0
        self.progress: Callable[[int], None] | None = None  # called with requests finished so far
        self.arrived: list[RequestRecord] = []  # in arrival order (a controller reads the new ones)
        self.completed: list[RequestRecord] = []  # in completion order
        self._controller: Callable[[FleetSim], None] | None = None
        self._on_empty_pool: Callable[[FleetSim], None] | None = None
        self._tick_s: float | None = None

    # ---- the loop -----------------------------------------------------------------------------

    def run(self, requests: Sequence[TraceRequest], controller: Callable[[FleetSim], None] | None = None,
            tick_s: float | None = None, wake: Callable[[FleetSim], None] | None = None) -> None:
        """Replay `requests`. With a `controller` (the planner's simulated connector), it is called
        every `tick_s` of simulated time while anything remains to happen, and may `apply` changes;
        `wake`, at once whenever a request arrives to a serving pool with no replica up or starting
        (scaled to zero), as a live frontend wakes its planner."""
        if controller is not None and not (tick_s and tick_s > 0):
            raise ValueError("a controller needs tick_s > 0")
        self._controller, self._tick_s, self._on_empty_pool = controller, tick_s, wake
        if controller is not None:
            self._push(tick_s, TICK, None)  # type: ignore[arg-type]
        for role in ("agg", "prefill", "decode"):
            for _ in range(getattr(self.config, role)):
                self._add_replica(role, ready_at=0.0)
        self._check_power()
        for request in requests:
            self._push(request.arrival_s, ARRIVE, request)
        for change in sorted(self.config.changes, key=lambda c: c.at_s):
            self._push(change.at_s, CHANGE, change)
        handlers = {ARRIVE: self._on_arrival, STEP: self._on_step, PULLED: self._on_pulled,
                    UP: self._on_up, CHANGE: self._on_change, TICK: self._on_tick}
        while self._heap:
            t, _, kind, payload = heapq.heappop(self._heap)
            self.events_processed += 1
            self._sample_until(t)
            self.now = t
            handlers[kind](payload)
        self._sample_until(self.now + self.config.interval_s)
        for record in self.records.values():
            if not record.finished and not record.rejected:
                record.rejected = "never finished (no replica served it)"

    def _on_tick(self, _: object) -> None:
        self._controller(self)  # type: ignore[misc]
        if self._heap:  # something remains to happen: keep watching
            self._push(self.now + self._tick_s, TICK, None)  # type: ignore[operator]

    def apply(self, change: FleetChange) -> ChangeRecord:
        """Add, remove or re-role replicas now (a controller's action); the record says what happened."""
        self._on_change(change)
        return self.change_log[-1]

    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (t, next(self._order), kind, payload))

    # ---- arrivals and routing -------------------------------------------------------------------

    def _on_arrival(self, request: TraceRequest) -> None:
        self._arrivals_in_interval += 1
        record = RequestRecord(request.request_id, request.arrival_s, request.input_tokens, request.output_tokens)
        self.records[request.request_id] = record
        self.arrived.append(record)
        serving_role = self.serving_role
        need = request.input_tokens + request.output_tokens
        if need > self._capacity_tokens[serving_role]:
            record.rejected = f"needs {need} KV tokens, a {serving_role} replica holds {self._capacity_tokens[serving_role]}"
            return
        for admitted in self.admission.arrive(request):
            self._route(admitted)

    def _route(self, request: TraceRequest) -> None:
        role = self.serving_role
        pool = self._serving(role)
        if not pool:
            self.backlog.append(request)
            if self._on_empty_pool is not None and not any(r.role == role and r.state == "starting"
                                                           for r in self.replicas.values()):
                self._on_empty_pool(self)
            return
        record = self.records[request.request_id]
        routing = RoutingRequest(request.request_id, request.block_hashes, request.input_tokens)
        decision = self.routers[role].select(routing, [r.worker_id for r in pool])
        target = self.replicas[decision.worker]
        record.worker = target.worker_id
        seq = SimSeq(request.request_id, request.input_tokens, request.output_tokens, _blocks_of(request),
                     priority=self.admission.priority(request))
        if role == "decode" and self._prefill_remotely(request, decision.overlap_blocks, record):
            self._send_to_prefill(request, routing, record, target)
            return
        if role == "decode":
            self.local_prefills[target.worker_id] += 1
        target.worker.add(seq)
        self._wake(target)

    def _prefill_remotely(self, request: TraceRequest, overlap_blocks: int, record: RequestRecord) -> bool:
        prefill_pool = self._serving("prefill")
        if prefill_pool and request.input_tokens + 1 > self._capacity_tokens["prefill"]:
            self.policy.counts[(LOCAL, "prompt_exceeds_prefill_kv")] += 1  # it could never be admitted there
            record.prefill, record.prefill_reason = LOCAL, "prompt_exceeds_prefill_kv"
            return False
        queues = [self.prefill_in_flight[r.worker_id] for r in prefill_pool]
        choice = self.policy.decide(request.input_tokens, overlap_blocks * self.config.block_size, queues,
                                    self.local_prefills[record.worker])
        record.prefill, record.prefill_reason = choice.decision, choice.reason
        return choice.decision == REMOTE

    def _send_to_prefill(self, request: TraceRequest, routing: RoutingRequest, record: RequestRecord,
                         decode: Replica) -> None:
        pool = [r.worker_id for r in self._serving("prefill")]
        chosen = self.replicas[self.routers["prefill"].select(routing, pool).worker]
        record.prefill_worker = chosen.worker_id
        self.prefill_in_flight[chosen.worker_id] += 1
        decode.pending_imports += 1
        seq = SimSeq(request.request_id, request.input_tokens, request.output_tokens,
                     _blocks_of(request), prefill_only=True, priority=self.admission.priority(request))
        chosen.worker.add(seq)
        self._wake(chosen)

    # ---- steps ------------------------------------------------------------------------------------

    def _wake(self, replica: Replica) -> None:
        """New work for `replica`: start a step, or cut its decode run at the next step boundary."""
        if replica.run is None:
            self._start(replica)
        elif replica.run.truncate(self.now):
            replica.version += 1
            self._push(replica.run.end, STEP, (replica, replica.version))

    def _start(self, replica: Replica) -> None:
        if replica.start_step(self.now):
            self._push(replica.run.end, STEP, (replica, replica.version))  # type: ignore[union-attr]
        else:
            self._maybe_retire(replica)

    def _on_step(self, payload: tuple[Replica, int]) -> None:
        replica, version = payload
        if version != replica.version or replica.run is None:
            return  # superseded by a truncated run's own event
        run = replica.finish_step()
        for seq in replica.worker.complete(run.batch, run.steps):
            self._emitted(replica, seq, run)
        self._start(replica)

    def _emitted(self, replica: Replica, seq: SimSeq, run: Run) -> None:
        record = self.records[seq.request_id]
        first = record.first_token_s is None
        if run.steps == 1:
            record.token_at(self.now)
        else:
            record.tokens_in_run(run.t0 + run.f0, self.now, run.steps, max(run.f0, run.f1))
        if first:
            record.cached_tokens = seq.cached_tokens  # the prefill that made the first token
        if seq.finished:
            record.preemptions += seq.preemptions
        if seq.prefill_only:
            self._handoff(replica, seq, record)
            return
        if first and record.prefill == LOCAL:
            self.local_prefills[replica.worker_id] -= 1
        if first:  # as the live frontend does with the first delta: the blocks the worker says it holds
            self.routers[self.serving_role].on_progress(seq.request_id, seq.num_tokens, seq.cached_tokens)
        if seq.finished:
            self._request_done(seq.request_id)

    def _request_done(self, request_id: str) -> None:
        self.routers[self.serving_role].on_finished(request_id)
        self.completed.append(self.records[request_id])
        self.finished += 1
        if self.progress is not None:
            self.progress(self.finished)
        record = self.records[request_id]
        for admitted in self.admission.done(request_id, record.input_tokens + record.tokens):
            self._route(admitted)

    # ---- disaggregated handoff -------------------------------------------------------------------

    def _handoff(self, prefill: Replica, seq: SimSeq, record: RequestRecord) -> None:
        """The prefill replica made the first token: the decode replica pulls the KV it lacks."""
        self.prefill_in_flight[prefill.worker_id] -= 1
        self.routers["prefill"].on_finished(seq.request_id)
        self.routers["decode"].on_first_token(seq.request_id)
        decode = self.replicas[record.worker]
        if seq.output_tokens <= 1:
            prefill.worker.release(seq.request_id)
            decode.pending_imports -= 1
            self._request_done(seq.request_id)
            self._maybe_retire(decode)
            return
        pulled = SimSeq(seq.request_id, seq.prompt_tokens, seq.output_tokens, SeqBlocks(list(seq.kv.hashes), seq.kv.salt),
                        num_tokens=seq.prompt_tokens + 1, priority=seq.priority)
        lacking = decode.worker.begin_import(pulled)
        if lacking is None:  # no room to land the KV: prefill it again there (never decode from nothing)
            prefill.worker.release(seq.request_id)
            decode.pending_imports -= 1
            decode.worker.add(pulled)
            self._wake(decode)
            return
        seconds = prefill.clock.transfer_seconds(lacking, decode.gpus)
        self._push(self.now + seconds, PULLED, (prefill, decode, seq.request_id))

    def _on_pulled(self, payload: tuple[Replica, Replica, str]) -> None:
        prefill, decode, request_id = payload
        decode.pending_imports -= 1
        decode.worker.finish_import(request_id)
        prefill.worker.release(request_id)
        self._wake(decode)
        self._wake(prefill)  # released blocks may let a waiting prompt in

    # ---- replicas: add, start, drain, re-role ------------------------------------------------------

    def _blocks(self, role: str) -> int:
        if self.config.kv_blocks is not None:
            return self.config.kv_blocks
        tokens = self.clocks[role].kv_capacity_tokens()
        if tokens < self.config.block_size:
            flag = "--layout" if role == "agg" else f"--{role}-layout"
            raise ValueError(f"{flag}: {self.clocks[role].profile.describe()} leaves no memory for KV "
                             "(the weights do not fit); use more GPUs per replica")
        return tokens // self.config.block_size

    def _add_replica(self, role: str, ready_at: float) -> Replica:
        worker_id = f"{role}-{next(self._names)}"
        events = KVEventEmitter(worker_id)
        events.subscribe(self.routers[role].apply_event)
        worker = SimWorker(worker_id, role, WorkerConfig(self._blocks(role), self.config.block_size,
                                                         self.config.max_num_seqs,
                                                         self.config.max_num_batched_tokens), events)
        replica = Replica(worker, self.clocks[role], self.now)
        self.replicas[worker_id] = replica
        if ready_at <= self.now:
            self._on_up(replica)
        else:
            self._push(ready_at, UP, replica)
        return replica

    def _on_up(self, replica: Replica) -> None:
        if replica.state != "starting":
            return
        replica.state, replica.up_s = "up", self.now
        self.routers[replica.role].add_worker(replica.worker_id)
        self.routers[replica.role].report_capacity(replica.worker_id, self._blocks(replica.role))  # as heartbeats do
        pending, self.backlog = self.backlog, deque()
        for request in pending:
            self._route(request)

    def _on_change(self, change: FleetChange) -> None:
        if change.action == "add":
            applied, reason = self._apply_add(change.role, change.count)
        else:
            applied, reason = self._apply_remove(change.role, change.count, change.to_role)
        self.change_log.append(ChangeRecord(self.now, change.action, change.role, change.count, applied, reason))

    def _apply_add(self, role: str, count: int) -> tuple[int, str]:
        added = 0
        for _ in range(count):
            if not self._power_allows(self.clocks[role].profile.gpus, role):
                return added, f"power cap {self.config.power_cap_kw:g} kW reached after {added}"
            self._add_replica(role, self.now + self.config.replica_startup_s)
            added += 1
        return added, f"started; serving from {self.now + self.config.replica_startup_s:.1f} s"

    def _apply_remove(self, role: str, count: int, to_role: str | None) -> tuple[int, str]:
        live = [r for r in self.replicas.values() if r.role == role and r.state in ("starting", "up")]
        chosen = sorted(live, key=lambda r: r.created_s)[::-1][:count]  # newest first
        for replica in chosen:
            if replica.state == "up":
                self.routers[role].remove_worker(replica.worker_id)
            replica.state, replica.rerole_to = "draining", to_role
            self._maybe_retire(replica)
        short = "" if len(chosen) == count else f" (only {len(chosen)} {role} replicas were live)"
        return len(chosen), ("draining" + (f", then re-roled to {to_role}" if to_role else "") + short)

    def _maybe_retire(self, replica: Replica) -> None:
        if replica.state != "draining" or not replica.is_idle():
            return
        replica.state, replica.gone_s = "gone", self.now
        role = replica.rerole_to
        if role is None:
            return
        if self._power_allows(self.clocks[role].profile.gpus, role):
            self._add_replica(role, self.now + self.config.replica_startup_s)
        else:
            self.change_log.append(ChangeRecord(self.now, "rerole", replica.role, 1, 0,
                                                f"{replica.worker_id} drained; power cap "
                                                f"{self.config.power_cap_kw:g} kW refuses it as {role}"))

    # ---- power and sampling -------------------------------------------------------------------------

    def provisioned(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state != "gone"]

    def _power_allows(self, extra_gpus: int, role: str) -> bool:
        cap = self.config.power_cap_kw
        if cap is None:
            return True
        watts = sum(r.gpus * r.clock.context.gpu.power_w for r in self.provisioned())
        return watts + extra_gpus * self.clocks[role].context.gpu.power_w <= cap * 1e3

    def _check_power(self) -> None:
        if not self._power_allows(0, next(iter(self.clocks))):
            raise ValueError(f"--power-cap-kw: the initial fleet draws more than {self.config.power_cap_kw:g} kW")

    def _serving(self, role: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.role == role and r.state == "up"]

    def _sample_until(self, t: float) -> None:
        while self._next_sample <= t:
            serving = [r for r in self.replicas.values() if r.state == "up"]
            provisioned = self.provisioned()
            self.intervals.append(IntervalRecord(
                start_s=self._next_sample - self.config.interval_s, arrivals=self._arrivals_in_interval,
                queue_depth=len(self.backlog) + sum(len(r.worker.waiting) for r in provisioned),
                running=sum(len(r.worker.running) for r in provisioned),
                kv_usage=sum(r.worker.kv.usage() for r in serving) / len(serving) if serving else 0.0,
                gpus=sum(r.gpus for r in provisioned),
                replicas=dict(Counter(r.role for r in serving))))
            self._arrivals_in_interval = 0
            self._next_sample += self.config.interval_s
