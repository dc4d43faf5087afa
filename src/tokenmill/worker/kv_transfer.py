"""A worker's side of disaggregated serving: KV transfer handles out, KV pulls in.

Prefill side: the engine's KV pool lives in shared memory (`allocator()`), registered with a
`TransferAgent` as region "kv". When a prefill-only request ends, `handle_for` turns its held
blocks into a handle (ARCHITECTURE.md "KV transfer handle": the agent's metadata, the pool layout, the
block ids, the prompt length, the first token and one xxh3 checksum per block). The blocks stay
held until the decode worker's `release` notification arrives, or `hold_timeout_s` passes.

Decode side: `pull(handle, plan)` copies the remote blocks from `plan.first_block` on into the
local blocks the engine allocated, verifies every block against its checksum and returns
whether all of it arrived intact — any failure (bad handle, dropped connection, timeout,
mismatch) is False, and the engine recomputes the prompt instead. Either way the prefill worker
is told to release its blocks — as it is at once when the engine had no room to land them
(`decline`), rather than left holding them until its timeout.

`TransferFaults` (`worker/transfer_faults.py`, `--transfer-faults`) injects the failures the
tests and drills need.

Between mock engines there are no bytes to move; with `--mock-profile` a pull still takes what
the profile's link would (`mock_transfer_seconds(tokens pulled)`, an asyncio sleep, so heartbeats
go on), and without one it is instant.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.engine.async_engine import AsyncLLMEngine, KVImport
from tokenmill.engine.kv_handoff import ImportPlan
from tokenmill.textgen.outputs import RequestOutput
from tokenmill.transfer import (
    Backend,
    Descriptor,
    KVLayout,
    SharedTensor,
    TransferAgent,
    allocate_shared_tensor,
    kv_block_descriptors,
    kv_pair_descriptors,
)
from tokenmill.transfer.releases import PeerBook, released_request, send_release
from tokenmill.worker.transfer_faults import TransferFaults

log = logging.getLogger(__name__)

REGION = "kv"
THREAD_CHECKSUM_BLOCKS = 64  # from here on checksums run off the event loop


@dataclass(slots=True)
class TransferCounters:
    handles: int = 0  # handed out (prefill side)
    released_by_ack: int = 0
    released_by_timeout: int = 0
    pulls: int = 0  # attempted (decode side)
    pull_failures: int = 0
    declined: int = 0  # not pulled: no room in the local pool, recomputed here
    bytes: int = 0
    seconds: float = 0.0
    failure_reasons: dict[str, int] = field(default_factory=dict)


class KVTransferService:
    def __init__(self, worker_id: str, backends: Sequence[str | Backend] = ("shm", "tcp"), hold_timeout_s: float = 30.0,
                 pull_timeout_s: float = 10.0, faults: TransferFaults | None = None,
                 mock_transfer_seconds: Callable[[int], float] | None = None) -> None:
        """`mock_transfer_seconds(tokens)`: how long a pull between mock engines (no bytes to
        move) waits for that many pulled tokens; None: no wait."""
        self.agent = TransferAgent(f"{worker_id}-{uuid.uuid4().hex[:8]}", backends)
        self.hold_timeout_s = hold_timeout_s
        self.pull_timeout_s = pull_timeout_s
        self.faults = faults or TransferFaults()
        self.mock_transfer_seconds = mock_transfer_seconds
        self.counters = TransferCounters()
        self.pool: SharedTensor | None = None
        self.layout: KVLayout | None = None
        self._engine: AsyncLLMEngine | None = None
        self._peers = PeerBook(self.agent)
        self._tasks: set[asyncio.Task[None]] = set()
        self._drop_lock = asyncio.Lock()
        self._pulls_started = 0  # numbers each pull for `faults`

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The engine's KV allocator: the pool in shared memory, so a same-host peer maps it."""
        self.pool = allocate_shared_tensor(shape, dtype)
        return self.pool.tensor

    async def start(self, engine: AsyncLLMEngine) -> None:
        self._engine = engine
        await self.agent.start()
        if self.pool is not None:
            self.agent.register(self.pool.region(REGION))
            self.layout = KVLayout.of_tensor(self.pool.tensor)
        self._spawn(self._release_on_notification())
        self._spawn(self._release_expired())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.agent.close()
        if self.pool is not None:
            self.pool.close()

    def load(self) -> dict[str, float]:
        c = self.counters
        return {"kv_handles": c.handles, "kv_released_by_ack": c.released_by_ack,
                "kv_released_by_timeout": c.released_by_timeout, "kv_pulls": c.pulls,
                "kv_pull_failures": c.pull_failures, "kv_imports_declined": c.declined,
                "kv_transfer_bytes": c.bytes,
                "kv_transfer_seconds": c.seconds}

    # -- prefill side ---------------------------------------------------------------------

    async def handle_for(self, out: RequestOutput) -> dict[str, Any]:
        """The transfer handle for a request that ended with FINISH_HANDOFF."""
        self.counters.handles += 1
        checksums = await self._checksums(out.held_block_ids) if self.layout is not None else []
        return {"agent": self.agent.metadata(), "request_id": out.request_id,
                "layout": self.layout.to_dict() if self.layout is not None else None,
                "block_ids": list(out.held_block_ids), "num_tokens": out.num_prompt_tokens,
                "first_token": out.new_token_ids[0], "checksums": checksums}

    async def release(self, request_id: str, why: str) -> None:
        if self._engine is not None and await self._engine.release_held(request_id):
            log.debug("released the KV of %s (%s)", request_id, why)

    async def _release_on_notification(self) -> None:
        async for note in self.agent.notifications():
            request_id = released_request(note)
            if request_id is not None and self._engine is not None and await self._engine.release_held(request_id):
                self.counters.released_by_ack += 1

    async def _release_expired(self) -> None:
        while self._engine is not None:
            await asyncio.sleep(min(1.0, self.hold_timeout_s / 2))
            timeout = self.hold_timeout_s
            for request_id in await self._engine.call(lambda e: e.handoff.expired(timeout)):
                if await self._engine.release_held(request_id):
                    self.counters.released_by_timeout += 1
                    log.warning("released the KV of %s: no decode worker acknowledged in %.0f s",
                                request_id, timeout)

    async def num_held(self) -> int:
        return 0 if self._engine is None else int(await self._engine.call(lambda e: len(e.handoff.held)))

    # -- decode side ----------------------------------------------------------------------

    async def pull(self, handle: dict[str, Any], plan: ImportPlan) -> bool:
        """Copy the handle's blocks into `plan.block_ids`; True only if every byte verified.
        A pull is counted as it ends, with its outcome and no await between them, so no load
        snapshot (heartbeat) shows a pull without its failure."""
        started = time.perf_counter()
        self._pulls_started += 1
        try:
            reason = await self._pull(handle, plan, self._pulls_started)
        finally:
            self.counters.pulls += 1
        if reason is not None:
            self.counters.pull_failures += 1
            key = reason.split(":")[0]
            self.counters.failure_reasons[key] = self.counters.failure_reasons.get(key, 0) + 1
            log.warning("KV pull for %s failed (%s); recomputing its prompt", plan.request_id, reason)
        self.counters.seconds += time.perf_counter() - started
        self._spawn(self._send_release(handle, plan.request_id))
        return reason is None

    def kv_import(self, handle: object) -> KVImport:
        """The engine's side of a pull of `handle` (ValueError for one that is not a map)."""
        if not isinstance(handle, dict):
            raise ValueError("kv_handle must be a map")
        return KVImport(lambda plan: self.pull(handle, plan), lambda: self.decline(handle))

    def decline(self, handle: dict[str, Any]) -> None:
        """The engine had no room for the handle's blocks and recomputes the prompt: the prefill
        worker may free them now."""
        self.counters.declined += 1
        log.info("no room to land the KV of %s; recomputing its prompt here", handle.get("request_id"))
        self._spawn(self._send_release(handle, str(handle.get("request_id", ""))))

    async def _pull(self, handle: dict[str, Any], plan: ImportPlan, number: int) -> str | None:
        """None when the KV arrived intact, else why not (`number`: this pull's, for `faults`)."""
        try:
            peer, src, dst, expected = self._plan_pull(handle, plan)
        except (ValueError, KeyError, TypeError) as exc:
            return f"bad handle: {exc}"
        if self.faults.delay_s:
            await asyncio.sleep(self.faults.delay_s)
        if peer is None:  # both sides run the mock engine: there are no bytes to move
            return await self._mock_move(plan)
        if self.faults.drops(number):  # one at a time, so each dropped connection is this pull's own
            async with self._drop_lock:
                return await self._move(peer, src, dst, expected, plan, number)
        return await self._move(peer, src, dst, expected, plan, number)

    async def _move(self, peer: str, src: list[Descriptor], dst: list[Descriptor], expected: list[int],
                    plan: ImportPlan, number: int) -> str | None:
        try:
            transfer = self.agent.read(peer, src, dst, timeout=self.pull_timeout_s)
        except ValueError as exc:  # e.g. no backend reaches the peer
            return f"bad handle: {exc}"
        if self.faults.drops(number):
            self._spawn(self._peers.drop_connection(transfer, peer))
        try:
            await transfer.wait()
        except asyncio.CancelledError:
            transfer.cancel()  # and wait: the engine frees these blocks right after we return
            await asyncio.shield(transfer.wait())
            raise
        if not transfer.ok:
            self._peers.forget(peer)  # reconnect (or learn of a restart) next time
            return f"transfer: {transfer.reason}"
        self.counters.bytes += transfer.bytes
        if self.faults.corrupts(number):
            self._corrupt(plan.block_ids[-1])
        if await self._checksums(plan.block_ids) != expected:
            return "checksum: the received KV does not match the prefill worker's"
        return None

    async def _mock_move(self, plan: ImportPlan) -> str | None:
        """Wait what moving the pulled blocks would take on the profile's link (if any); a wait
        beyond the pull timeout fails as a real transfer would, and the prompt is recomputed."""
        if self.mock_transfer_seconds is None:
            return None
        block_size = self._engine.engine.config.block_size if self._engine is not None else 0
        tokens = max(plan.num_tokens - plan.first_block * block_size, 0)
        seconds = self.mock_transfer_seconds(tokens)
        if seconds > self.pull_timeout_s:
            await asyncio.sleep(self.pull_timeout_s)
            return f"transfer: the modelled {seconds:.2f} s exceeds the {self.pull_timeout_s:g} s pull timeout"
        await asyncio.sleep(seconds)
        return None

    def _plan_pull(self, handle: dict[str, Any], plan: ImportPlan,
                   ) -> tuple[str | None, list[Descriptor], list[Descriptor], list[int]]:
        """(peer, source, destination, expected checksums); peer None when there is nothing to
        move (mock engines). ValueError/KeyError/TypeError for a handle that does not fit."""
        remote_ids = [int(b) for b in handle["block_ids"]][plan.first_block:]
        expected = [int(c) for c in handle["checksums"]][plan.first_block:]
        if len(remote_ids) != len(plan.block_ids):
            raise ValueError(f"{len(remote_ids)} remote blocks for {len(plan.block_ids)} local ones")
        if int(handle["num_tokens"]) != plan.num_tokens:
            raise ValueError(f"handle covers {handle['num_tokens']} tokens, the request {plan.num_tokens}")
        if handle.get("layout") is None or self.layout is None:
            if handle.get("layout") is None and self.layout is None:
                return None, [], [], expected
            raise ValueError("one side keeps no KV pool in shared memory (mixed mock and torch workers?)")
        remote_layout = KVLayout.from_dict(handle["layout"])
        if len(expected) != len(remote_ids):
            raise ValueError("one checksum per block is required")
        peer = self._peers.remote(handle["agent"])
        src, dst = kv_pair_descriptors(remote_layout, REGION, remote_ids, self.layout, REGION, plan.block_ids)
        return peer, src, dst, expected

    async def _send_release(self, handle: dict[str, Any], request_id: str) -> None:
        try:
            holder = handle["agent"]
        except (KeyError, TypeError):
            log.info("no agent in the handle of %s to release it with", request_id)
            return
        await send_release(self._peers, holder, request_id)

    # -- helpers --------------------------------------------------------------------------

    async def _checksums(self, block_ids: Sequence[int]) -> list[int]:
        if len(block_ids) >= THREAD_CHECKSUM_BLOCKS:
            return await asyncio.to_thread(self._checksums_now, list(block_ids))
        return self._checksums_now(block_ids)

    def _checksums_now(self, block_ids: Sequence[int]) -> list[int]:
        layout = self.layout
        if layout is None:
            return []
        return [self.agent.checksum(kv_block_descriptors(layout, REGION, [b])) for b in block_ids]

    def _corrupt(self, block_id: int) -> None:
        if self.pool is not None:
            self.pool.tensor[0, 0, block_id].view(torch.uint8).view(-1)[0] ^= 0xFF

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
