"""The worker side of `TokenmillConnector`, in the process of vLLM's worker (where the KV cache lives:
the engine core's own on a CPU, unless vLLM's multiprocess executor runs it).

vLLM calls it from its model runner, one step at a time; its `TransferAgent` runs on an asyncio
loop in a thread of its own, so pulls and notifications go on between and during steps.

Prefill side: each attention layer's cache is registered as region `kv{i}`; at the end of the step
that completes a prefill request's prompt, `seal` writes each of its blocks' checksum and the
request's stamp into the `sums` region. Blocks vLLM holds for a finished request (`StepJobs.held`)
are reported finished sending once a decode worker's `{"release": ID}` arrives, or after
`hold_timeout_s`.

Decode side: `load` pulls the remote blocks into the local ones vLLM allocated, reads the remote
`sums` rows into `sums_in`, and accepts only if each row carries the handle's stamp and the
checksum of the bytes that arrived; anything else (a bad handle, a dropped connection, a timeout,
a mismatch) reports the request as a failed receive, and vLLM recomputes its prompt. Either way
the prefill worker is told to release its blocks.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenmill.engines.vllm.connector_jobs import LoadJob, SealJob, StepJobs, stamp
from tokenmill.transfer import Backend, Descriptor, TransferAgent, host_region
from tokenmill.transfer.releases import PeerBook, released_request, send_release
from tokenmill.worker.transfer_faults import TransferFaults

log = logging.getLogger(__name__)

SUMS, SUMS_IN = "sums", "sums_in"
ROW_BYTES = 16  # a sums row: (checksum, stamp), two uint64


class WorkerSide:
    def __init__(self, worker_id: str, backends: Sequence[Backend], hold_timeout_s: float = 30.0,
                 pull_timeout_s: float = 10.0, faults: TransferFaults | None = None) -> None:
        self.agent = TransferAgent(f"{worker_id}-vllm-{uuid.uuid4().hex[:8]}", backends)
        self.hold_timeout_s = hold_timeout_s
        self.pull_timeout_s = pull_timeout_s
        self.faults = faults or TransferFaults()
        self.layout: dict[str, Any] = {}
        self._block_bytes: list[int] = []  # per layer
        self._layers: list[Any] = []
        self._sums = np.zeros((0, 2), np.uint64)
        self._sums_in = np.zeros((0, 2), np.uint64)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokenmill-kv-agent", daemon=True)
        self._lock = threading.Lock()  # the sets below: written by the agent's loop, read by vLLM's steps
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self._releases: dict[str, float] = {}  # id -> when its release arrived (maybe before it is held)
        self._held: dict[str, float] = {}  # id -> hold deadline
        self._peers = PeerBook(self.agent)
        self._pulls_started = 0  # numbers each pull for `faults` (on the agent's loop only)
        self._releases_task: asyncio.Task[None] | None = None

    # -- setup ------------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any]) -> None:
        """vLLM's per-layer caches (block id = index on dim 0); starts the agent."""
        self._layers = list(kv_caches.values())
        num_blocks = int(self._layers[0].shape[0])
        self._block_bytes = [int(t[0].numel() * t.element_size()) for t in self._layers]
        self._sums = np.zeros((num_blocks, 2), np.uint64)
        self._sums_in = np.zeros((num_blocks, 2), np.uint64)
        self.layout = {"engine": "vllm", "num_blocks": num_blocks, "dtype": str(self._layers[0].dtype),
                       "layers": [list(t.shape[1:]) for t in self._layers]}
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()

    async def _start(self) -> None:
        await self.agent.start()
        for i, layer in enumerate(self._layers):
            self.agent.register(host_region(f"kv{i}", layer))
        self.agent.register(host_region(SUMS, self._sums))
        self.agent.register(host_region(SUMS_IN, self._sums_in))
        self._releases_task = asyncio.get_running_loop().create_task(self._take_releases())

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    async def _close(self) -> None:
        """End what runs on the agent's loop (the release listener, pulls and releases in flight)."""
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self.agent.close()

    # -- each step ----------------------------------------------------------------------------

    def start_loads(self, jobs: StepJobs) -> None:
        now = time.monotonic()
        with self._lock:
            for request_id in jobs.held:
                self._held[request_id] = now + self.hold_timeout_s
        for job in jobs.loads:
            asyncio.run_coroutine_threadsafe(self._load(job), self._loop)

    def seal(self, jobs: StepJobs) -> None:
        """Checksum the blocks this step's prefill requests wrote (vLLM calls this after the step)."""
        for job in jobs.seals:
            self._seal(job)

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving: also in finished receiving)."""
        now = time.monotonic()
        with self._lock:
            sent = {rid for rid, deadline in self._held.items() if rid in self._releases or deadline <= now}
            for request_id in sent:
                del self._held[request_id]
                if self._releases.pop(request_id, None) is None:
                    log.warning("released the KV of %s: no decode worker acknowledged in %.0f s", request_id,
                                self.hold_timeout_s)
            for request_id, arrived in list(self._releases.items()):  # for requests never held here
                if arrived + self.hold_timeout_s <= now:
                    del self._releases[request_id]
            received, failed = self._received | self._failed, set(self._failed)
            self._received.clear()
            self._failed.clear()
        return sent, received, failed

    # -- prefill side -------------------------------------------------------------------------

    def _seal(self, job: SealJob) -> None:
        mark = np.uint64(stamp(job.request_id))
        for block_id in job.block_ids:
            self._sums[block_id] = (np.uint64(self._checksum(block_id)), mark)

    async def _take_releases(self) -> None:
        async for note in self.agent.notifications():
            request_id = released_request(note)
            if request_id is not None:
                with self._lock:
                    self._releases[request_id] = time.monotonic()

    # -- decode side --------------------------------------------------------------------------

    async def _load(self, job: LoadJob) -> None:
        """Pull, then release the prefill worker's blocks; a job without blocks only releases
        (vLLM did not wait for it, so it is not reported as received)."""
        if job.block_ids:
            self._pulls_started += 1
            try:
                reason = await self._pull(job, self._pulls_started)
            except Exception as exc:  # noqa: BLE001 - whatever went wrong, the prompt is recomputed
                reason = f"error: {exc!r}"
            with self._lock:
                (self._failed if reason is not None else self._received).add(job.request_id)
            if reason is not None:
                log.warning("KV pull for %s failed (%s); recomputing its prompt", job.request_id, reason)
        if isinstance(job.handle.get("agent"), dict):
            await send_release(self._peers, job.handle["agent"], str(job.handle.get("remote_request_id", "")))

    async def _pull(self, job: LoadJob, number: int) -> str | None:
        """None when every block arrived and verified, else why not (`number`: this pull's, for `faults`)."""
        handle = job.handle
        remote_ids = [int(b) for b in handle["block_ids"]][job.first_block:job.first_block + len(job.block_ids)]
        if len(remote_ids) != len(job.block_ids):
            return f"bad handle: {len(remote_ids)} remote blocks for {len(job.block_ids)} local ones"
        if handle.get("layout") != self.layout:
            return "bad handle: the prefill worker's KV layout differs from this worker's"
        peer = self._peers.remote(handle["agent"])
        if self.faults.delay_s:
            await asyncio.sleep(self.faults.delay_s)
        src = [d for b in remote_ids for d in self._block_descriptors(b)]
        dst = [d for b in job.block_ids for d in self._block_descriptors(b)]
        rows = [Descriptor(SUMS, b * ROW_BYTES, ROW_BYTES) for b in remote_ids]
        rows_in = [Descriptor(SUMS_IN, b * ROW_BYTES, ROW_BYTES) for b in job.block_ids]
        # both reads start at once: rows read before or after the KV, a block changed meanwhile
        # fails its stamp or its checksum either way
        for what, transfer in (("KV", self.agent.read(peer, src, dst, timeout=self.pull_timeout_s)),
                               ("checksums", self.agent.read(peer, rows, rows_in, timeout=self.pull_timeout_s))):
            faults = [self._peers.drop_connection(transfer, peer)] if self.faults.drops(number) else []
            await asyncio.gather(transfer.wait(), *faults)
            if not transfer.ok:
                self._peers.forget(peer)
                return f"transfer of the {what}: {transfer.reason}"
        if self.faults.corrupts(number):
            self._flip(job.block_ids[-1])
        # off the agent's loop: other pulls and the release notifications go on meanwhile
        return await asyncio.to_thread(self._verify, job.block_ids, np.uint64(int(handle["stamp"])))

    def _verify(self, block_ids: list[int], expected: np.uint64) -> str | None:
        for block_id in block_ids:
            checksum, mark = self._sums_in[block_id]
            if mark != expected:
                return "checksum: the prefill worker no longer holds these blocks"
            if int(checksum) != self._checksum(block_id):
                return "checksum: the received KV does not match the prefill worker's"
        return None

    # -- bytes --------------------------------------------------------------------------------

    def _block_descriptors(self, block_id: int) -> list[Descriptor]:
        return [Descriptor(f"kv{i}", block_id * size, size) for i, size in enumerate(self._block_bytes)]

    def _checksum(self, block_id: int) -> int:
        return self.agent.checksum(self._block_descriptors(block_id))

    def _flip(self, block_id: int) -> None:
        """Fault injection: one bit of a received block, before it is verified."""
        layer = self._layers[-1]
        raw = layer[block_id].view(-1)
        raw.view(dtype=_byte_dtype())[0] ^= 0xFF


def _byte_dtype() -> Any:
    import torch

    return torch.uint8
