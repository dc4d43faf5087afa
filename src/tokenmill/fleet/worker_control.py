"""Runtime scaling of `tokenmill serve`'s workers: what `/admin/workers` starts, drains and lists.

Every worker has a record: `starting` (its process runs, it has not registered), `serving`
(this frontend's pool holds it: registered, so ready), `draining` (it takes nothing new and
exits once what it holds has finished), `gone` (it exited after a drain), `failed` (a start
that exited before registering or did not register within `start_timeout_s`, or a crash the
supervisor would not restart; `reason` says why, with the end of its stderr).

A drain marks the worker in the pool at once (no new requests from this frontend), then sends it
SIGUSR1: the worker says `draining` in its heartbeats (the other API servers stop routing to it),
finishes every request it holds and lets its held KV be pulled, then exits; its exit is settled
as `gone` and never restarted. A worker started here that exits before it ever registered is a
failed start, not restarted either; launch workers keep the supervisor's restarts.
"""
from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.fleet.worker_pool import WorkerPool
from tokenmill.fleet.worker_processes import WorkerSupervisor
from tokenmill.runtime.supervisor import ChildSpec

log = logging.getLogger(__name__)

STARTING, SERVING, DRAINING, GONE, FAILED = "starting", "serving", "draining", "gone", "failed"
LIVE = frozenset({STARTING, SERVING, DRAINING})
NAME_PREFIX = {"agg": "worker", "prefill": "prefill", "decode": "decode"}
KEEP_ENDED = 64  # gone and failed records kept for the planner to read
TAIL_IN_REASON = 5  # stderr lines quoted in a failure's reason


@dataclass(slots=True)
class WorkerRecord:
    name: str
    role: str
    origin: str  # "launch" (a --workers/--prefill/--decode one) or "admin"
    pid: int
    start_deadline: float  # time.monotonic() by which it must register
    state: str = STARTING
    started_at: float = field(default_factory=time.time)  # of its current process
    restarts: int = 0
    served: bool = False  # registered at least once
    reason: str | None = None
    exit_code: int | None = None


class WorkerCommandRefused(Exception):
    """A worker command that cannot be carried out as asked. `kind` says why: `invalid` (the
    command contradicts itself), `not_found` (no such worker) or `conflict` (the fleet's state
    forbids it now); `param` names the command's field at fault and `code` the reason, as the
    API's error JSON spells them (`api/errors.py` turns this into a 400, 404 or 409)."""

    KINDS = ("invalid", "not_found", "conflict")

    def __init__(self, kind: str, message: str, param: str | None, code: str | None = None) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {', '.join(self.KINDS)}, got {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.param = param
        self.code = code


def conflict(message: str, param: str | None, code: str) -> WorkerCommandRefused:
    return WorkerCommandRefused("conflict", message, param, code)


class WorkerControl:
    """`spec_for(name, role)` is the command line of a worker of that role, with the launch flags."""

    def __init__(self, supervisor: WorkerSupervisor, pool: WorkerPool, spec_for: Callable[[str, str], ChildSpec],
                 roles: tuple[str, ...], launch: list[tuple[str, str]], start_timeout_s: float = 300.0) -> None:
        self.supervisor = supervisor
        self.pool = pool
        self.spec_for = spec_for
        self.roles = roles
        self.start_timeout_s = start_timeout_s
        self.records: dict[str, WorkerRecord] = {}
        self.may_be_empty = False  # scale to zero: the last serving worker may go (requests wait for the next)
        self._next_index: Counter[str] = Counter()
        for name, role in launch:  # launch workers boot as long as they need, as before
            self.records[name] = WorkerRecord(name, role, "launch", supervisor.pid(name), math.inf)
            self._next_index[NAME_PREFIX[role]] += 1
        supervisor.may_restart = self._may_restart
        supervisor.on_settled = self._settled

    async def run(self, interval_s: float = 0.2) -> None:
        while True:
            try:
                self.observe()
            except Exception:  # a bug here must not freeze every record in its state
                log.exception("observing the workers failed")
            await asyncio.sleep(interval_s)

    def observe(self) -> None:
        """Starting workers that registered now serve; ones past their deadline have failed."""
        now = time.monotonic()
        for rec in self.records.values():
            conn = self.pool.connections.get(rec.name)
            mine = conn is not None and conn.info.pid == rec.pid
            if rec.state == STARTING and mine:
                rec.state, rec.served, rec.reason = SERVING, True, None
            elif rec.state == STARTING and now > rec.start_deadline:
                self._fail(rec, f"did not register within {self.start_timeout_s:g} s")
                self.supervisor.send_signal(rec.name, signal.SIGKILL)
            if rec.state == SERVING and mine and conn.draining:  # drained by someone else (a signal)
                rec.state = DRAINING

    def start(self, role: str, count: int) -> list[WorkerRecord]:
        started = []
        for _ in range(count):
            name = self._new_name(role)
            rec = WorkerRecord(name, role, "admin", 0, time.monotonic() + self.start_timeout_s)
            self.records[name] = rec
            started.append(rec)
            try:
                rec.pid = self.supervisor.add(self.spec_for(name, role))
            except OSError as exc:
                self._fail(rec, f"could not start its process: {exc}")
                continue
            log.info("started %s worker %s (pid %d)", role, name, rec.pid)
        self._trim()
        return started

    def newest(self, role: str, count: int) -> list[str]:
        """The `count` most recently started serving workers of `role`."""
        self.observe()
        serving = sorted((r for r in self.records.values() if r.role == role and r.state == SERVING),
                         key=lambda r: (r.started_at, r.name), reverse=True)
        if len(serving) < count:
            raise conflict(f"only {len(serving)} {role} workers are serving; cannot drain {count}", "count",
                           "not_enough_workers")
        return [r.name for r in serving[:count]]

    def drain(self, names: list[str], param: str = "worker") -> list[WorkerRecord]:
        self.observe()
        records = [self._drainable(name, param) for name in names]
        self._check_someone_serves(records, param)
        for rec in records:
            rec.state = DRAINING
            self.pool.mark_draining(rec.name)
            # SIGUSR1: a serving worker drains gracefully; one still booting (no handler yet,
            # nothing registered, nothing held) dies of it, which is as good
            self.supervisor.send_signal(rec.name, signal.SIGUSR1)
            log.info("draining %s (pid %d)", rec.name, rec.pid)
        return records

    def rerole(self, name: str, to: str) -> tuple[WorkerRecord, WorkerRecord]:
        """Drain the worker and start its replacement in role `to` (a role is fixed for a process)."""
        self.observe()
        rec = self._drainable(name, "worker")
        if rec.state != SERVING:
            raise conflict(f"worker {name} is {rec.state}; only a serving worker changes role", "worker",
                           "worker_not_serving")
        if rec.role == to:
            raise WorkerCommandRefused("invalid", f"worker {name} is already a {to} worker", "to")
        self._check_someone_serves([rec], "worker")
        replacement = self.start(to, 1)[0]
        return self.drain([name])[0], replacement

    def snapshot(self) -> dict[str, Any]:
        """`GET /admin/workers`: every record, and the live ones counted by role and state."""
        self.observe()
        replicas: dict[str, Counter[str]] = {role: Counter() for role in self.roles}
        for rec in self.records.values():
            if rec.state in LIVE:
                replicas.setdefault(rec.role, Counter())[rec.state] += 1
        return {"object": "list", "data": [self.describe(rec) for rec in self.records.values()],
                "replicas": {role: {s: counts[s] for s in (STARTING, SERVING, DRAINING)}
                             for role, counts in replicas.items()}}

    def describe(self, rec: WorkerRecord) -> dict[str, Any]:
        """A record as JSON; `in_flight` and `requests_served` are from its last heartbeat."""
        conn = self.pool.connections.get(rec.name)
        load = conn.load if conn is not None and conn.info.pid == rec.pid and rec.state in LIVE else {}
        return {"name": rec.name, "role": rec.role, "state": rec.state, "pid": rec.pid,
                "in_flight": int(load.get("in_flight", 0)), "requests_served": int(load.get("requests_served", 0)),
                "started_at": round(rec.started_at, 3), "restarts": rec.restarts, "origin": rec.origin,
                "exit_code": rec.exit_code, "reason": rec.reason}

    def _drainable(self, name: str, param: str) -> WorkerRecord:
        rec = self.records.get(name)
        if rec is None:
            raise WorkerCommandRefused("not_found", f"no worker named {name!r}", param, "worker_not_found")
        if rec.state not in (STARTING, SERVING):
            raise conflict(f"worker {name} is already {rec.state}", param, "worker_not_serving")
        return rec

    def _check_someone_serves(self, leaving: list[WorkerRecord], param: str) -> None:
        """Refuse to take the last serving agg/decode worker away: requests would have nowhere to go
        (unless the pool may be empty: they then wait for a worker to start)."""
        if self.may_be_empty:
            return
        names = {r.name for r in leaving}
        serving = [r for r in self.records.values() if r.state == SERVING and r.role != "prefill"]
        if any(r.name in names for r in serving) and all(r.name in names for r in serving):
            role = "decode" if "decode" in self.roles else "agg"
            raise conflict(f"that would leave no {role} worker serving; start another first", param,
                           "last_serving_worker")

    def _new_name(self, role: str) -> str:
        prefix = NAME_PREFIX[role]
        index = self._next_index[prefix]
        self._next_index[prefix] += 1
        return f"{prefix}-{index}"

    def _may_restart(self, name: str) -> bool:
        rec = self.records.get(name)
        if rec is None:
            return True  # not a worker: an API server
        return rec.state in (STARTING, SERVING) and (rec.served or rec.origin == "launch")

    def _settled(self, name: str, code: int, restarted: bool) -> None:
        rec = self.records.get(name)
        if rec is None:
            return
        rec.exit_code = code
        if restarted:
            rec.pid, rec.state, rec.started_at = self.supervisor.pid(name), STARTING, time.time()
            rec.restarts += 1
            rec.reason = f"restarted after it exited with code {code}"
            if rec.origin == "admin":
                rec.start_deadline = time.monotonic() + self.start_timeout_s
        elif rec.state == DRAINING:
            rec.state, rec.reason = GONE, None
        elif rec.state != FAILED:  # a timed-out start keeps its reason
            when = "before it registered" if rec.state == STARTING else "and was not restarted"
            self._fail(rec, f"exited with code {code} {when}")
        self._trim()

    def _fail(self, rec: WorkerRecord, why: str) -> None:
        tail = [line for line in self.supervisor.tail(rec.name) if line.strip()][-TAIL_IN_REASON:]
        rec.state, rec.reason = FAILED, why + (": " + " | ".join(tail) if tail else "")
        log.error("worker %s failed: %s", rec.name, rec.reason)

    def _trim(self) -> None:
        ended = [name for name, rec in self.records.items() if rec.state not in LIVE]
        for name in ended[:max(0, len(ended) - KEEP_ENDED)]:
            del self.records[name]
