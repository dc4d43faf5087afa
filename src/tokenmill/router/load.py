"""Per-worker load as the router sees it: active prefill blocks and active decode blocks.

The router keeps its own books on the requests it routes, charged the moment it routes
them, in the same terms a worker measures itself (`LLMEngine._active_blocks`):

- routed (`on_routed`): the request's prefill charge — the prompt blocks the router expects
  it to compute — until its first token;
- first token (`on_first_token`): the prefill charge is released and the request's decode
  blocks are charged instead (the blocks it allocated beyond its prefix hits);
- every delta (`on_progress`): the decode charge follows the request's length,
  ceil(tokens / block_size) − cached_tokens // block_size, with the cached count the worker
  itself reported; so the charge tracks the worker's figure within one step;
- finished (`on_finished`, also for an abort or error): everything is released.

Unknown request ids are ignored, so late or repeated calls are harmless.

A worker's heartbeat also tells each frontend the load of the requests *other* frontends
sent it (`set_external`); it is added as it is. A worker's report of this router's own
requests is never used to overwrite these books: it lags them (a request routed after the
worker measured is missing from it), and subtracting a lagging report would hide a burst
the router just sent and pile more onto the same worker.
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
    decode_blocks: float  # charged from the first token on
    prefilling: bool = True


@dataclass(slots=True)
class _WorkerTotals:
    prefill_blocks: float = 0.0
    decode_blocks: float = 0.0
    external: WorkerLoad = WorkerLoad()  # what other frontends' requests hold, per the worker


class LoadTracker:
    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
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
        """Charge `prefill_blocks` now; `decode_blocks` is the decode charge expected from the first token."""
        if prefill_blocks < 0 or decode_blocks < 0:
            raise ValueError(f"charges must be >= 0, got prefill {prefill_blocks}, decode {decode_blocks}")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already charged to {self._requests[request_id].worker!r}")
        totals = self._workers.get(worker)
        if totals is None:
            raise ValueError(f"unknown worker {worker!r}")
        self._requests[request_id] = _Charge(worker, prefill_blocks, decode_blocks)
        totals.prefill_blocks += prefill_blocks

    def on_first_token(self, request_id: str) -> None:
        charge = self._requests.get(request_id)
        if charge is None or not charge.prefilling:
            return
        charge.prefilling = False
        totals = self._workers.get(charge.worker)
        if totals is not None:
            totals.prefill_blocks -= charge.prefill_blocks
            totals.decode_blocks += charge.decode_blocks

    def on_progress(self, request_id: str, num_tokens: int, num_cached_tokens: int) -> None:
        """The request now holds `num_tokens` (prompt + output), `num_cached_tokens` of them
        found in the worker's prefix cache at admission."""
        self.on_first_token(request_id)
        charge = self._requests.get(request_id)
        totals = None if charge is None else self._workers.get(charge.worker)
        if totals is None:
            return
        blocks = float(max(0, -(-num_tokens // self.block_size) - num_cached_tokens // self.block_size))
        totals.decode_blocks += blocks - charge.decode_blocks
        charge.decode_blocks = blocks

    def on_finished(self, request_id: str) -> None:
        charge = self._requests.pop(request_id, None)
        totals = None if charge is None else self._workers.get(charge.worker)
        if totals is None:
            return
        if charge.prefilling:
            totals.prefill_blocks -= charge.prefill_blocks
        else:
            totals.decode_blocks -= charge.decode_blocks

    def set_external(self, worker: str, prefill_blocks: float, decode_blocks: float) -> None:
        """The load of requests this router did not route, as the worker last reported it."""
        if prefill_blocks < 0 or decode_blocks < 0:
            raise ValueError(f"reported load must be >= 0, got prefill {prefill_blocks}, decode {decode_blocks}")
        totals = self._workers.get(worker)
        if totals is not None:
            totals.external = WorkerLoad(prefill_blocks, decode_blocks)

    def tracked(self, worker: str) -> WorkerLoad:
        """This router's own requests on `worker` (no external load)."""
        totals = self._workers.get(worker)
        if totals is None:
            return WorkerLoad()
        return WorkerLoad(max(0.0, totals.prefill_blocks), max(0.0, totals.decode_blocks))

    def load(self, worker: str) -> WorkerLoad:
        totals = self._workers.get(worker)
        if totals is None:
            return WorkerLoad()
        own, external = self.tracked(worker), totals.external
        return WorkerLoad(own.prefill_blocks + external.prefill_blocks, own.decode_blocks + external.decode_blocks)

    def worker_of(self, request_id: str) -> str | None:
        charge = self._requests.get(request_id)
        return None if charge is None else charge.worker

    def num_requests(self) -> int:
        return len(self._requests)
