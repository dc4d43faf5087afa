"""Per-worker load as the router sees it: active prefill blocks and active decode blocks.

The router keeps its own books on the requests it routes, charged the moment it routes
them, in the same terms a worker measures itself (`engine.stats.request_blocks`):

- routed (`on_routed`): the request's prefill charge — the prompt blocks the router expects
  it to compute — until its first token;
- first token (`on_first_token`): the prefill charge is released and the request's decode
  blocks are charged instead (the blocks it allocated beyond its prefix hits);
- every delta (`on_progress`): the decode charge follows the request's length,
  ceil(tokens / block_size) − cached_tokens // block_size, with the cached count the worker
  itself reported; so the charge tracks the worker's figure within one step;
- finished (`on_finished`, also for an abort or error): everything is released.

Unknown request ids are ignored, so late or repeated calls are harmless.

Beside the load, the books hold what the routed requests occupy on each worker's device:
the distinct prompt blocks of its active requests (shared prefixes once) plus each request's
blocks beyond them (`held_blocks`). With the pool size the worker reports (`set_capacity`),
that says whether a request would find room there or wait for blocks to free (cost.py).

A worker's heartbeat also tells each frontend the load of the requests *other* frontends
sent it (`set_external`); it is added as it is. A worker's report of this router's own
requests is never used to overwrite these books: it lags them (a request routed after the
worker measured is missing from it), and subtracting a lagging report would hide a burst
the router just sent and pile more onto the same worker.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE


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
    block_hashes: Sequence[int] = ()  # its prompt's full blocks
    extra_blocks: int = 0  # blocks it holds beyond those: a partial last block, its output
    prefilling: bool = True


@dataclass(slots=True)
class _WorkerTotals:
    prefill_blocks: float = 0.0
    decode_blocks: float = 0.0
    external: WorkerLoad = WorkerLoad()  # what other frontends' requests hold, per the worker
    held: Counter[int] = field(default_factory=Counter)  # prompt block -> active requests holding it
    extra_blocks: int = 0
    capacity_blocks: int | None = None  # the worker's device pool (None: not reported)


class LoadTracker:
    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
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

    def on_routed(self, request_id: str, worker: str, prefill_blocks: float, decode_blocks: float,
                  block_hashes: Sequence[int] = (), prompt_blocks: int | None = None) -> None:
        """Charge `prefill_blocks` now; `decode_blocks` is the decode charge expected from the first
        token. `block_hashes` (the prompt's full blocks) and `prompt_blocks` (with a partial last
        one) count what the request will hold on the worker's device."""
        if prefill_blocks < 0 or decode_blocks < 0:
            raise ValueError(f"charges must be >= 0, got prefill {prefill_blocks}, decode {decode_blocks}")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already charged to {self._requests[request_id].worker!r}")
        totals = self._workers.get(worker)
        if totals is None:
            raise ValueError(f"unknown worker {worker!r}")
        extra = max(0, (prompt_blocks if prompt_blocks is not None else len(block_hashes)) - len(block_hashes))
        self._requests[request_id] = _Charge(worker, prefill_blocks, decode_blocks, block_hashes, extra)
        totals.prefill_blocks += prefill_blocks
        totals.held.update(block_hashes)
        totals.extra_blocks += extra

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
        total = -(-num_tokens // self.block_size)
        blocks = float(max(0, total - num_cached_tokens // self.block_size))
        totals.decode_blocks += blocks - charge.decode_blocks
        charge.decode_blocks = blocks
        extra = max(0, total - len(charge.block_hashes))
        totals.extra_blocks += extra - charge.extra_blocks
        charge.extra_blocks = extra

    def on_finished(self, request_id: str) -> None:
        charge = self._requests.pop(request_id, None)
        totals = None if charge is None else self._workers.get(charge.worker)
        if totals is None:
            return
        if charge.prefilling:
            totals.prefill_blocks -= charge.prefill_blocks
        else:
            totals.decode_blocks -= charge.decode_blocks
        totals.held.subtract(charge.block_hashes)
        for block in charge.block_hashes:
            if totals.held[block] <= 0:
                del totals.held[block]
        totals.extra_blocks -= charge.extra_blocks

    def set_external(self, worker: str, prefill_blocks: float, decode_blocks: float) -> None:
        """The load of requests this router did not route, as the worker last reported it."""
        if prefill_blocks < 0 or decode_blocks < 0:
            raise ValueError(f"reported load must be >= 0, got prefill {prefill_blocks}, decode {decode_blocks}")
        totals = self._workers.get(worker)
        if totals is not None:
            totals.external = WorkerLoad(prefill_blocks, decode_blocks)

    def set_capacity(self, worker: str, num_blocks: int | None) -> None:
        """The worker's device KV pool, in blocks (its heartbeat's `num_blocks`)."""
        totals = self._workers.get(worker)
        if totals is not None:
            totals.capacity_blocks = num_blocks if num_blocks is None else int(num_blocks)

    def shortfall(self, worker: str, block_hashes: Sequence[int], prompt_blocks: int) -> float | None:
        """Blocks the request would lack on the worker's device beyond what its active requests hold
        (0: it fits; None: capacity unknown). Its blocks already held by an active request are shared."""
        totals = self._workers.get(worker)
        if totals is None or totals.capacity_blocks is None:
            return None
        held = totals.held
        needed = prompt_blocks - sum(1 for block in block_hashes if block in held)
        in_use = len(held) + totals.extra_blocks
        return float(max(0, in_use + needed - totals.capacity_blocks))

    def held_blocks(self, worker: str) -> int:
        """Device blocks this router's active requests hold on `worker` (shared prompt blocks once)."""
        totals = self._workers.get(worker)
        return 0 if totals is None else len(totals.held) + totals.extra_blocks

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
