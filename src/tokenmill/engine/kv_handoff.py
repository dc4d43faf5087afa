"""KV handed between engines in disaggregated serving: the engine side of a transfer.

Prefill side: a request added with `prefill_only` stops after its first token; instead of
freeing its blocks, the engine *holds* them (`hold`) so a decode worker can pull the prompt's KV,
until the worker `release`s them (the decode side acknowledged, or the hold timed out). Held
blocks stay registered in the prefix cache, so later prompts still hit them after release.

Decode side: `begin_import` admits a request whose prompt KV lives elsewhere: it takes local
prefix-cache hits first, allocates fresh blocks for the rest of the prompt and parks the request
outside the scheduler while the worker copies the remote blocks in. `finish_import(ok=True)`
registers the blocks and hands the request to the scheduler with its prompt computed, so its
next step is a decode; `ok=False` frees the blocks (never registered, so nothing partial can be
hit later) and queues the request to be prefilled here — a failed transfer is recomputed, never
decoded from.

Invariant: a request is in at most one of scheduler, `held`, `importing`; every block a request
owns is freed exactly once, by `release`, `finish_import(ok=False)`, `abort` or the scheduler.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler
from tokenmill.kv.cache_manager import KVCacheManager


@dataclass(slots=True)
class ImportPlan:
    """Where a remote prompt's KV must land: remote blocks from `first_block` on go, in order,
    into local `block_ids` (the blocks before `first_block` were local prefix-cache hits)."""

    request_id: str
    num_tokens: int  # prompt positions whose KV the remote engine computed
    first_block: int
    block_ids: list[int]


@dataclass(slots=True)
class _Import:
    request: Request
    num_tokens: int


class KVHandoff:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.held: dict[str, float] = {}  # request id -> monotonic time the hold began
        self.importing: dict[str, _Import] = {}

    # -- prefill side ---------------------------------------------------------------------

    def hold(self, request_id: str) -> list[int]:
        """Keep a finished request's blocks; returns their ids in prompt order."""
        self.held[request_id] = time.monotonic()
        return self.kv.block_ids(request_id)

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks (they stay in the prefix cache); False if not held."""
        if self.held.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    def expired(self, older_than_s: float) -> list[str]:
        cutoff = time.monotonic() - older_than_s
        return [rid for rid, since in self.held.items() if since < cutoff]

    # -- decode side ----------------------------------------------------------------------

    def begin_import(self, request: Request) -> ImportPlan | None:
        """Allocate blocks for every position of `request` but the last (the remote engine
        computed those; the last is the token it sampled); None, with nothing allocated, when
        the pool cannot hold them."""
        rid, bs = request.request_id, self.kv.block_size
        num_tokens = request.num_tokens - 1
        if num_tokens <= 0:
            raise ValueError("a KV import needs the prompt and the remotely sampled token")
        # at most num_tokens // bs full blocks: find_cached_prefix leaves the last position out
        cached = self.kv.find_cached_prefix(rid, request.token_ids, request.extra_key)
        if not self.kv.allocate(rid, num_tokens, cached):
            self.kv.free(rid)
            return None
        first = cached.num_tokens // bs
        request.num_cached_tokens, request.admitted = cached.num_tokens, True
        request.num_computed_tokens = cached.num_tokens
        self.importing[rid] = _Import(request, num_tokens)
        return ImportPlan(rid, num_tokens, first, self.kv.block_ids(rid)[first:])

    def finish_import(self, request_id: str, ok: bool) -> bool:
        """Schedule an imported request: decoding when `ok`, else recomputing. False if unknown."""
        entry = self.importing.pop(request_id, None)
        if entry is None:
            return False
        request = entry.request
        if ok:
            request.num_computed_tokens = entry.num_tokens
            self.kv.cache_computed(request_id, request.token_ids, entry.num_tokens)
            self.scheduler.run_imported(request)
        else:
            self.kv.free(request_id)
            request.num_computed_tokens = 0
            request.admitted = False
            self.scheduler.add(request)
        return True

    def abort(self, request_id: str) -> bool:
        """Drop a held or importing request and free its blocks."""
        if self.release(request_id):
            return True
        if self.importing.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True
