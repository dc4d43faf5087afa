"""A vLLM worker's side of disaggregated serving, as the worker server sees it (the own engine's
is `worker/kv_transfer.py`): the KV itself moves between vLLM processes through
`TokenmillConnector`; this process only carries handles.

Prefill side: a prefill-only request's last output carries the connector's handle
(`VLLMEngine.take_handle`), which `handle_for` passes on. A frontend whose client left sends an
abort after the handoff; `release` then tells the connector's agent to free the held blocks at
once instead of at its hold timeout.

Decode side: `kv_import(handle)` wraps the handle for `VLLMEngine.generate`, which gives it to
vLLM as the request's kv_transfer_params; the connector pulls, verifies, recomputes on failure and
releases the prefill worker's blocks.

Not here: the held count a drain waits for (the connector's worker process keeps it), so a
draining vLLM prefill worker stops without waiting for pulls; one it cuts is recomputed.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenmill.transfer import TcpBackend, TransferAgent
from tokenmill.transfer.releases import PeerBook, send_release

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class RemotePrefill:
    """A decode request's prompt KV, held by a prefill worker's connector."""
    handle: dict[str, Any]


class VLLMHandoff:
    def __init__(self, worker_id: str, hold_timeout_s: float) -> None:
        self.hold_timeout_s = hold_timeout_s
        self._agent = TransferAgent(f"{worker_id}-handoff-{uuid.uuid4().hex[:8]}", [TcpBackend()])
        self._peers = PeerBook(self._agent)
        self._engine: Any = None
        # request id -> (when, handle), oldest first: the frontend may abort one within its hold
        self._handed: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        self.handles = 0

    async def start(self, engine: Any) -> None:
        self._engine = engine
        await self._agent.start()

    async def close(self) -> None:
        await self._agent.close()

    def load(self) -> dict[str, float]:
        return {"kv_handles": self.handles}

    async def num_held(self) -> int:
        return 0

    async def handle_for(self, out: Any) -> dict[str, Any] | None:
        handle = self._engine.take_handle(out.request_id)
        if handle is None:
            return None
        self.handles += 1
        now = time.monotonic()
        while self._handed and next(iter(self._handed.values()))[0] + self.hold_timeout_s <= now:
            self._handed.popitem(last=False)  # its hold is over: the prefill side freed it already
        self._handed[out.request_id] = (now, handle)
        return handle

    async def release(self, request_id: str, why: str) -> None:
        kept = self._handed.pop(request_id, None)
        if kept is None:
            return
        handle = kept[1]
        if await send_release(self._peers, handle["agent"], str(handle["remote_request_id"])):
            log.debug("released the KV of %s (%s)", request_id, why)

    def kv_import(self, handle: object) -> RemotePrefill:
        if not isinstance(handle, dict):
            raise ValueError("kv_handle must be a map")
        return RemotePrefill(handle)
