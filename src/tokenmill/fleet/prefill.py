"""A request's prefill on the prefill pool (disaggregated serving, ARCHITECTURE.md "The disaggregated path").

`RemotePrefill.run` sends the prompt as a prefill-only generate to a prefill worker chosen
by the prefill pool's router, and yields the first token the moment that worker answers,
keeping the KV transfer handle that came with it on the request's progress for the decode
attempt. A prefill worker that dies, refuses (overloaded) or fails is excluded and the next
one tried, up to `max_prefill_attempts`; then the policy records `prefill_failed` and the
decode worker prefills the prompt itself. A handle no decode worker took (the client left, the
deadline passed, the decode worker refused it: it was draining) is `discard`ed: the prefill
worker frees its blocks at once instead of waiting for its hold to time out. A decode worker
has taken it once it answers with tokens (`settled`): it pulled the blocks or recomputed them.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from tokenmill.fleet.worker_pool import LOST, WorkerConnection, WorkerPool, next_message
from tokenmill.kv.hashing import block_hashes
from tokenmill.router.decision import RoutingRequest
from tokenmill.router.disagg import DisaggPolicy
from tokenmill.router.policies import NoWorkerAvailable
from tokenmill.runtime import protocol as p
from tokenmill.textgen.outputs import FINISH_ABORT, FINISH_HANDOFF, RequestOutput

if TYPE_CHECKING:
    from tokenmill.fleet.request_progress import RequestProgress

log = logging.getLogger(__name__)

_RETRY = "retry"


class RemotePrefill:
    def __init__(self, pool: WorkerPool, policy: DisaggPolicy) -> None:
        self.pool = pool
        self.policy = policy
        self.in_flight: Counter[str] = Counter()  # prefill worker -> prefills awaiting its answer
        self.deployed = False  # a prefill worker has been seen: decisions are counted from then on
        self._holders: dict[str, str] = {}  # request id -> prefill worker holding its KV

    def queues(self) -> list[int]:
        """Prefills in flight on each live prefill worker (empty: no prefill pool now)."""
        workers = self.pool.in_pool(prefill=True)
        self.deployed = self.deployed or bool(workers)
        return [self.in_flight[w] for w in workers]

    async def run(self, request_id: str, progress: RequestProgress, deadline: float) -> AsyncIterator[RequestOutput]:
        tried: set[str] = set()
        for _ in range(self.policy.config.max_prefill_attempts):
            conn = self._pick(request_id, progress, tried)
            if conn is None:
                break
            tried.add(conn.worker_id)
            result = await self._attempt(conn, request_id, progress, deadline)
            if isinstance(result, RequestOutput):
                yield result
                return
        self.policy.fell_back()
        log.warning("remote prefill of %s failed on %s; prefilling on the decode worker", request_id, sorted(tried))

    def settled(self, request_id: str) -> None:
        """A decode worker answered the request that carried the handle: it releases the blocks."""
        self._holders.pop(request_id, None)

    def discard(self, request_id: str) -> None:
        """Free the KV a prefill worker holds for a request that will not be decoded from it."""
        worker = self._holders.pop(request_id, None)
        conn = self.pool.connections.get(worker) if worker else None
        if conn is not None:
            conn.send({"type": p.ABORT, "request_id": request_id})

    def _pick(self, request_id: str, progress: RequestProgress, tried: set[str]) -> WorkerConnection | None:
        candidates = [w for w in self.pool.in_pool(prefill=True) if w not in tried]
        if not candidates:
            return None
        block_size, seed = self.pool.hashing()
        request = RoutingRequest(request_id, block_hashes(progress.prompt, block_size, seed), len(progress.prompt))
        try:
            return self.pool.connections[self.pool.prefill_router.select(request, candidates).worker]
        except NoWorkerAvailable:
            return None

    async def _attempt(self, conn: WorkerConnection, request_id: str, progress: RequestProgress,
                       deadline: float) -> RequestOutput | str:
        """The first token (its handle kept on `progress`), or _RETRY to try another worker."""
        worker = conn.worker_id
        queue = conn.open_stream(request_id)
        self.in_flight[worker] += 1
        answered = False
        try:
            conn.send(p.generate_message(request_id, progress.prompt, progress.params, None, 0,
                                         max(0.0, deadline - time.monotonic()), prefill_only=True))
            msg = await next_message(queue, deadline)
            answered = msg is not None
            if msg is None:
                return progress.end(request_id, FINISH_ABORT)
            return self._result(worker, request_id, msg, progress)
        finally:
            self.in_flight[worker] -= 1
            self.pool.prefill_router.on_finished(request_id)
            conn.close_stream(request_id)
            if not answered and worker in self.pool.connections:
                conn.send({"type": p.ABORT, "request_id": request_id})

    def _result(self, worker: str, request_id: str, msg: dict[str, Any], progress: RequestProgress) -> RequestOutput | str:
        if msg is LOST or msg["type"] == p.ERROR and msg.get("code") in (p.INTERNAL, p.OVERLOADED):
            log.warning("prefill worker %s could not prefill %s: %s", worker, request_id, msg.get("message", "lost"))
            return _RETRY
        if msg["type"] == p.ERROR:
            raise ValueError(str(msg.get("message", "invalid request")))
        out = p.output_from_wire(msg)
        if out.finish_reason != FINISH_HANDOFF:  # the first token ended it (eos, stop, max_tokens=1)
            return out
        handle = msg.get("kv_handle")
        if not isinstance(handle, dict):
            log.warning("prefill worker %s sent no KV handle for %s", worker, request_id)
        else:
            progress.hold_handle(handle)
            self._holders[request_id] = worker
        return dataclasses.replace(out, finished=False, finish_reason=None, held_block_ids=[])
