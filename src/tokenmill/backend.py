"""What the HTTP layer needs from whatever serves tokens behind it.

`LocalBackend` (one in-process engine, `embedded_backend.py`) and `DistributedBackend`
(worker processes over the request plane, `fleet/`) both implement `Backend`; the HTTP app
(`api/`) only ever sees this interface. A leaf: `api` and `fleet` both import it, neither
imports the other through it.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from tokenmill.textgen.outputs import RequestOutput
from tokenmill.textgen.sampling import SamplingParams
from tokenmill.textgen.tokenizer import Tokenizer


class Overloaded(Exception):
    """Every worker queue is full: the client should retry after `retry_after` seconds."""

    def __init__(self, retry_after: float, message: str = "all workers are at their queue limit") -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BackendUnavailable(Exception):
    """No worker can take the request (none registered, or all failed); a 503."""


class Backend(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: Tokenizer

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 deadline: float | None = None, follow: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream deltas until one has `finished`; its `finish_reason` is stop/length/abort/error.

        `follow` names a request in flight with the same prompt (another choice of the same
        client request): serve this one where that one is served, so they share its prefill.

        Raises ValueError (a client mistake, message names the field) or `Overloaded`
        before the first delta. `deadline` is a `time.monotonic()` instant after which
        the request is aborted and finishes with reason "abort". Closing the iterator
        early aborts the request and frees its KV.
        """
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def healthy(self) -> bool:
        """True when at least one worker can serve."""
        ...

    async def pin_prefix(self, token_ids: list[int]) -> dict[str, str | None]:
        """Admin: pin a prefix in every worker's KV tiers; worker id -> None when pinned, else why not."""
        ...

    def metrics_snapshot(self) -> dict[str, float]:
        """Gauges for /metrics: per-worker KV usage, prefix hit rate, queue depth (flat names)."""
        ...


def tier_gauges(worker_id: str, load: dict[str, float]) -> dict[str, float]:
    """A worker's `tier_<tier>_<metric>` load keys (KV tiers below its device pool) as
    `tokenmill_worker_kv_tier_<metric>{worker,tier}` gauges."""
    gauges: dict[str, float] = {}
    for key, value in load.items():
        parts = key.split("_", 2)
        if parts[0] == "tier" and len(parts) == 3:
            gauges[f'tokenmill_worker_kv_tier_{parts[2]}{{tier="{parts[1]}",worker="{worker_id}"}}'] = float(value)
    return gauges
