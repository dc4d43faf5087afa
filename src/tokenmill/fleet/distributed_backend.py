"""The frontend's request orchestration over worker processes.

A request goes to a worker and its token frames are streamed back. If the worker
dies mid-stream, the request is re-issued to another worker with the prompt plus
the tokens generated so far (and the remaining budget), so the client sees one
unbroken stream; after `max_migrations` it ends with an error. Every request has a
deadline; closing the stream early aborts it on the worker, freeing its KV.

With prefill workers in the pool (disaggregated serving), the decode worker is chosen
first; `DisaggPolicy` then decides whether the prompt is prefilled remotely
(`fleet/prefill.py`: the first token streams to the client as soon as it exists, and
the decode worker is sent the request with the KV transfer handle) or on the decode
worker itself, exactly as in aggregated serving. The backend counts each decode worker's own
prefills (sent, no token back yet), which the policy bounds when the prefill pool is full.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.backend import BackendUnavailable, Overloaded, tier_gauges
from tokenmill.fleet.empty_pool import EmptyPoolWait
from tokenmill.fleet.inbox import StreamInbox
from tokenmill.fleet.prefill import RemotePrefill
from tokenmill.fleet.request_progress import RequestProgress
from tokenmill.fleet.worker_pool import LOST, WorkerConnection, WorkerPool, next_message
from tokenmill.kv.hashing import block_hashes
from tokenmill.router.decision import RoutingRequest
from tokenmill.router.disagg import REMOTE, DisaggConfig, DisaggPolicy
from tokenmill.router.index_view import index_view
from tokenmill.router.policies import NoWorkerAvailable
from tokenmill.runtime import protocol as p
from tokenmill.textgen.outputs import FINISH_ABORT, FINISH_ERROR, RequestOutput
from tokenmill.textgen.sampling import SamplingParams
from tokenmill.textgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class DistributedBackend:
    def __init__(self, pool: WorkerPool, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 max_migrations: int = 3, default_timeout_s: float = 600.0,
                 disagg: DisaggConfig | None = None) -> None:
        self.pool = pool
        self.router = pool.router  # the pool feeds it events and load; the backend routes with it
        self.disagg = DisaggPolicy(disagg or DisaggConfig())
        self.prefill = RemotePrefill(pool, self.disagg)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_migrations = max_migrations
        self.default_timeout_s = default_timeout_s
        self.migrations_total = 0
        self.local_prefills: Counter[str] = Counter()  # decode worker -> its own prefills before a token
        self.worker_control: Any = None  # `tokenmill serve`'s WorkerControl, for /admin/workers
        self.empty_pool: EmptyPoolWait | None = None  # scale to zero: requests wait for a worker to join

    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()

    def healthy(self) -> bool:
        """A worker serves; or none does, but the pool may be empty (scaled to zero) and a request
        waits for one to start."""
        return self.empty_pool is not None or bool(self.pool.in_pool(prefill=False))

    def router_index(self, with_hashes: bool) -> dict[str, Any]:
        """Admin: what each router's KV index holds (`router/index_view.py`), by pool."""
        routers = {"decode": self.pool.router, "prefill": self.pool.prefill_router}
        return {pool: {"policy": router.policy, **(index_view(router.indexer, with_hashes)
                                                     if router.indexer is not None else {})}
                for pool, router in routers.items() if router.workers or pool == "decode"}

    def metrics_snapshot(self) -> dict[str, float]:
        snap: dict[str, float] = {"tokenmill_workers": float(len(self.pool.connections)),
                                  "tokenmill_request_migrations_total": float(self.migrations_total),
                                  **self.router.metrics_snapshot(), **self.disagg.metrics_snapshot()}
        if self.empty_pool is not None:
            snap["tokenmill_requests_waiting_for_worker"] = float(self.empty_pool.waiting)
        for conn in self.pool.connections.values():
            for key in ("kv_usage", "prefix_hit_rate", "num_waiting", "num_running", "prefill_tokens",
                        "onboarded_tokens", "queried_tokens", "device_hit_tokens", "tiers_enabled", "num_held",
                        "num_importing", "kv_handles", "kv_pulls", "kv_pull_failures", "kv_imports_declined",
                        "kv_transfer_bytes", "kv_transfer_seconds", "spec_draft_tokens", "spec_accepted_tokens"):
                if key in conn.load:
                    snap[f'tokenmill_worker_{key}{{worker="{conn.worker_id}"}}'] = float(conn.load[key])
            if "busy_seconds" in conn.load:  # the worker's steps' time from its start: a counter
                snap[f'tokenmill_worker_busy_seconds_total{{worker="{conn.worker_id}"}}'] = float(conn.load["busy_seconds"])
            snap.update(tier_gauges(conn.worker_id, conn.load))
        if self.worker_control is not None:
            for role, states in self.worker_control.snapshot()["replicas"].items():
                for state, count in states.items():
                    snap[f'tokenmill_workers_by_state{{role="{role}",state="{state}"}}'] = float(count)
        return snap

    async def pin_prefix(self, token_ids: list[int], timeout_s: float = 30.0) -> dict[str, str | None]:
        """Send the prefix to every live worker; worker id -> None when pinned, else why not."""
        request_id = f"pin-{uuid.uuid4().hex}"
        conns = list(self.pool.connections.values())
        queues = [conn.open_stream(request_id) for conn in conns]
        try:
            for conn in conns:
                conn.send({"type": p.PIN, "request_id": request_id, "prompt_token_ids": list(token_ids)})
            replies = await asyncio.gather(*(_reply(q, timeout_s) for q in queues))
        finally:
            for conn in conns:
                conn.close_stream(request_id)
        return {conn.worker_id: None if reply.get("ok") else str(reply.get("error") or "refused")
                for conn, reply in zip(conns, replies, strict=True)}

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: float | None = None, follow: str | None = None) -> AsyncIterator[RequestOutput]:
        progress = RequestProgress(list(prompt_token_ids), params, follow=follow)
        deadline = deadline or time.monotonic() + self.default_timeout_s
        excluded: set[str] = set()
        try:
            while not progress.finished:
                conn = (await self._pick_or_wait(request_id, progress, excluded, deadline)
                        if progress.migrations <= self.max_migrations else None)
                if conn is None:
                    yield progress.end(request_id, FINISH_ERROR)
                    return
                try:
                    prefilled = False
                    if self._wants_remote_prefill(progress, conn.worker_id):
                        async for out in self.prefill.run(request_id, progress, deadline):
                            prefilled = True
                            self.router.on_first_token(request_id)
                            yield progress.account(out)
                    if not progress.finished:
                        attempt = self._attempt(conn, request_id, progress, deadline, excluded)
                        if self.prefill.deployed and not prefilled:  # the decode worker prefills it
                            attempt = self._counted(attempt, conn.worker_id)
                        async for out in attempt:
                            yield out
                finally:
                    self.router.on_finished(request_id)
        finally:
            self.prefill.discard(request_id)  # a handle no decode worker took: free its blocks now

    def _wants_remote_prefill(self, progress: RequestProgress, decode_worker: str) -> bool:
        """Only a fresh request to a decode worker (an aggregated one, while workers are re-roled,
        takes no KV), and only when the policy sends its prompt to the prefill pool."""
        if not progress.fresh or self.pool.connections[decode_worker].info.role == "agg":
            return False
        queues = self.prefill.queues()
        if not queues and not self.prefill.deployed:
            return False  # an aggregated deployment: nothing to decide, nothing to count
        choice = self.disagg.decide(len(progress.prompt), progress.cached_tokens_at_decode, queues,
                                    self.local_prefills[decode_worker])
        return choice.decision == REMOTE

    async def _counted(self, attempt: AsyncIterator[RequestOutput], worker: str) -> AsyncIterator[RequestOutput]:
        """`attempt`, counted among `worker`'s own prefills until its first output (or its end)."""
        self.local_prefills[worker] += 1
        counted = True
        try:
            async for out in attempt:
                if counted:
                    counted = False
                    self.local_prefills[worker] -= 1
                yield out
        finally:
            if counted:
                self.local_prefills[worker] -= 1

    async def _pick_or_wait(self, request_id: str, progress: RequestProgress, excluded: set[str],
                            deadline: float) -> WorkerConnection | None:
        """`_pick`; a fresh request that finds no worker at all waits for one where the pool may be
        empty (`empty_pool`), then is routed as usual."""
        try:
            return self._pick(request_id, progress, excluded)
        except BackendUnavailable:
            if self.empty_pool is None or excluded:
                raise
        if not await self.empty_pool.wait(lambda: bool(self.pool.in_pool(prefill=False)), deadline):
            raise BackendUnavailable(f"no worker started within {self.empty_pool.wait_s:g} s (--queue-timeout-s) "
                                     "while the pool was scaled to zero; retry later")
        return self._pick(request_id, progress, excluded)

    def _pick(self, request_id: str, progress: RequestProgress, excluded: set[str]) -> WorkerConnection | None:
        """The router's choice among live workers not yet tried; errors only before any output."""
        candidates = [w for w in self.pool.in_pool(prefill=False) if w not in excluded]
        if candidates:
            tokens = progress.tokens
            block_size, seed = self.pool.hashing()
            request = RoutingRequest(request_id, block_hashes(tokens, block_size, seed), len(tokens))
            followed = self.router.worker_of(progress.follow) if progress.follow else None
            if followed in candidates and not progress.migrations:
                candidates = [followed]  # the same prompt in flight there: the engine computes it once
            try:
                decision = self.router.select(request, candidates)
                progress.routed(decision.overlap_blocks * block_size)
                return self.pool.connections[decision.worker]
            except NoWorkerAvailable:
                pass
        if not progress.fresh:
            return None
        if excluded:
            raise Overloaded(retry_after=1.0)
        raise BackendUnavailable("no worker is available")

    async def _attempt(self, conn: WorkerConnection, request_id: str, progress: RequestProgress,
                       deadline: float, excluded: set[str]) -> AsyncIterator[RequestOutput]:
        queue = conn.open_stream(request_id)
        worker_done = False  # the worker has ended this attempt itself; no abort needed
        carried = progress.kv_handle is not None  # a prefill worker holds KV for this attempt
        try:
            conn.send(self._generate_message(request_id, progress, deadline))  # a failed send: LOST below
            while not progress.finished:
                msg = await next_message(queue, deadline)
                if msg is None:  # deadline passed
                    yield progress.end(request_id, FINISH_ABORT)
                elif msg is LOST or (msg["type"] == p.ERROR and msg.get("code") == p.INTERNAL):
                    worker_done = True
                    self._note_migration(conn, progress, excluded)
                    return
                elif msg["type"] == p.ERROR:
                    worker_done = True
                    self._raise_for_error(msg, conn, progress, excluded)
                    return
                else:
                    out = _merge_ready(p.output_from_wire(msg), queue)
                    if carried:  # the decode worker pulled the KV (or recomputed it): it releases it
                        carried = False
                        self.prefill.settled(request_id)
                    cached_here = out.num_cached_tokens  # this attempt's hit, before progress.account restates it
                    out = progress.account(out)
                    # the router's decode charge follows what the worker now holds (router/load.py)
                    self.router.on_progress(request_id, len(progress.prompt) + len(progress.generated),
                                                 cached_here)
                    worker_done = out.finished
                    yield out
        finally:
            conn.close_stream(request_id)
            if not worker_done and conn.worker_id in self.pool.connections:
                conn.send({"type": p.ABORT, "request_id": request_id})
            if carried:  # refused, lost or cut before it answered: free the held KV now, not at its timeout
                self.prefill.discard(request_id)

    def _generate_message(self, request_id: str, progress: RequestProgress, deadline: float) -> dict:
        return p.generate_message(request_id, progress.tokens, progress.params, None,
                                  len(progress.generated), max(0.0, deadline - time.monotonic()),
                                  progress.text_pending, kv_handle=progress.take_handle(),
                                  max_tokens=progress.max_new_tokens)

    def _note_migration(self, conn: WorkerConnection, progress: RequestProgress, excluded: set[str]) -> None:
        progress.migrated()
        self.migrations_total += 1
        excluded.add(conn.worker_id)
        log.warning("migrating a request off worker %s after %d tokens", conn.worker_id, len(progress.generated))

    def _raise_for_error(self, msg: dict, conn: WorkerConnection, progress: RequestProgress, excluded: set[str]) -> None:
        if msg.get("code") == p.OVERLOADED:  # refused (full, or draining): the next worker recomputes
            excluded.add(conn.worker_id)
            return
        if not progress.generated:
            raise ValueError(str(msg.get("message", "invalid request")))
        self._note_migration(conn, progress, excluded)


def _merge_ready(out: RequestOutput, inbox: StreamInbox) -> RequestOutput:
    """`out` joined with the token frames already waiting behind it: a consumer that fell
    behind (a busy frontend) catches up in one delta, one SSE event, instead of one per frame."""
    while not out.finished:
        nxt = inbox.peek()
        if nxt is None or nxt is LOST or nxt.get("type") != p.TOKENS:
            break
        inbox.get_nowait()
        more = p.output_from_wire(nxt)
        out.new_token_ids += more.new_token_ids
        out.new_text += more.new_text
        out.new_logprobs += more.new_logprobs
        out.finished, out.finish_reason, out.stop_reason = more.finished, more.finish_reason, more.stop_reason
        out.num_output_tokens, out.text_pending_tokens = more.num_output_tokens, more.text_pending_tokens
        out.step_seconds += more.step_seconds
    return out


async def _reply(inbox: StreamInbox, timeout_s: float) -> dict[str, Any]:
    reply = await inbox.get(time.monotonic() + timeout_s)
    return reply if reply is not None else {"ok": False, "error": "no answer from the worker"}
