"""Per-worker load as the router sees it: active prefill blocks and active decode blocks.

A routed request is charged to its worker at once (`on_routed`): `prefill_blocks` (the
blocks it must compute) until its first token (`on_first_token`), and `decode_blocks`
(the device blocks it allocates fresh) until it ends (`on_finished`, also for an
abort or error). Unknown request ids are ignored, so late or repeated calls are harmless.

Counting alone drifts (a lost finish, a request the worker preempted), so workers report
their own figures now and then and `correct(worker, prefill_blocks, decode_blocks)`
makes the tracked load equal to the report: the difference is kept as an offset that
later charges and releases move from. A report must measure what the router charges
(cost.py), per request the worker holds:
prefill_blocks = Σ, over requests not yet past their first token, of the prompt blocks
                 not found in its prefix cache at admission;
decode_blocks  = Σ, over all its live requests, of the device blocks each allocated fresh
                 (its block table minus its prefix-cache hits at admission).
Not the pool's used blocks: those also count shared prefixes held on behalf of finished
requests, which the router never charged, and would push traffic off a worker merely for
caching well (the integration test measures this). A request routed but not yet
admitted is missing from a report until the next one; that error does not accumulate.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class WorkerLoad:
    prefill_blocks: float = 0.0
    decode_blocks: float = 0.0

    @property
    def active_blocks(self) -> float:
        return self.prefill_blocks + self.decode_blocks


@dataclass(slots=True)
class _Charge:
    worker: str
    prefill_blocks: float
    decode_blocks: float
    prefilling: bool = True


@dataclass(slots=True)
class _WorkerTotals:
    prefill_blocks: float = 0.0
    decode_blocks: float = 0.0
    prefill_offset: float = 0.0  # report minus tracked, at the last correction
    decode_offset: float = 0.0


class LoadTracker:
    def __init__(self) -> None:
        self._workers: dict[str, _WorkerTotals] = {}
        self._requests: dict[str, _Charge] = {}

    def add_worker(self, worker: str) -> None:
        self._workers.setdefault(worker, _WorkerTotals())

    def remove_worker(self, worker: str) -> None:
        """Forget the worker and the requests charged to it."""
        self._workers.pop(worker, None)
        for request_id in [r for r, c in self._requests.items() if c.worker == worker]:
            del self._requests[request_id]

    def on_routed(self, request_id: str, worker: str, prefill_blocks: float, decode_blocks: float) -> None:
        if prefill_blocks < 0 or decode_blocks < 0:
            raise ValueError(f"charges must be >= 0, got prefill {prefill_blocks}, decode {decode_blocks}")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already charged to {self._requests[request_id].worker!r}")
        totals = self._workers.get(worker)
        if totals is None:
            raise ValueError(f"unknown worker {worker!r}")
        self._requests[request_id] = _Charge(worker, prefill_blocks, decode_blocks)
        totals.prefill_blocks += prefill_blocks
        totals.decode_blocks += decode_blocks

    def on_first_token(self, request_id: str) -> None:
        charge = self._requests.get(request_id)
        if charge is None or not charge.prefilling:
            return
        charge.prefilling = False
        totals = self._workers.get(charge.worker)
        if totals is not None:
            totals.prefill_blocks -= charge.prefill_blocks

    def on_finished(self, request_id: str) -> None:
        self.on_first_token(request_id)
        charge = self._requests.pop(request_id, None)
        totals = None if charge is None else self._workers.get(charge.worker)
        if totals is not None:
            totals.decode_blocks -= charge.decode_blocks

    def correct(self, worker: str, prefill_blocks: float, decode_blocks: float) -> None:
        """Make the worker's load equal its own report (see module doc)."""
        if prefill_blocks < 0 or decode_blocks < 0:
            raise ValueError(f"reported load must be >= 0, got prefill {prefill_blocks}, decode {decode_blocks}")
        totals = self._workers.get(worker)
        if totals is None:
            return
        totals.prefill_offset = prefill_blocks - totals.prefill_blocks
        totals.decode_offset = decode_blocks - totals.decode_blocks

    def load(self, worker: str) -> WorkerLoad:
        totals = self._workers.get(worker)
        if totals is None:
            return WorkerLoad()
        return WorkerLoad(max(0.0, totals.prefill_blocks + totals.prefill_offset),
                          max(0.0, totals.decode_blocks + totals.decode_offset))

    def worker_of(self, request_id: str) -> str | None:
        charge = self._requests.get(request_id)
        return None if charge is None else charge.worker

    def num_requests(self) -> int:
        return len(self._requests)
