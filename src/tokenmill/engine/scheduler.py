"""The engine's scheduler: continuous batching with chunked prefill and preemption by recompute.

The rules (decodes first, then running prefills, then admissions within a token budget; the
latest-admitted unscheduled request preempted when the pool is short) are `tokenmill.step_policy`,
which the fleet simulator's workers follow too. This module holds the engine's queues, finishes
and aborts requests, and records what a step computed (`advance`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.kv.cache_manager import CachedPrefix, KVCacheManager
from tokenmill.step_policy import plan_step
from tokenmill.textgen.outputs import FINISH_ABORT


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


@dataclass(slots=True)
class ScheduledSeq:
    """One request's part of a step, as scheduled (the request's tokens grow after the step; these
    fields do not)."""
    request: Request
    start: int  # first position computed this step
    num_tokens: int
    num_drafts: int = field(init=False)  # speculative tokens verified, after the request's known ones
    samples: bool = field(init=False)  # the step reaches the end of the known tokens: it samples

    def __post_init__(self) -> None:
        end, known = self.start + self.num_tokens, self.request.num_tokens
        self.num_drafts = max(0, end - known)
        self.samples = end >= known

    @property
    def is_decode(self) -> bool:
        """One new token past the client's prompt (and the drafts it verifies, if any)."""
        # a continued request's prompt ends with tokens generated elsewhere: past the client's prompt
        client_prompt = self.request.num_prompt_tokens - self.request.output_offset
        return self.num_tokens - self.num_drafts == 1 and self.start >= client_prompt


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_decode_seqs(self) -> int:
        return sum(1 for s in self.seqs if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs if not s.is_decode)

    @property
    def kv_tokens_read(self) -> int:
        return sum(s.start + s.num_tokens for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class _RequestBook:
    """The step policy's view of requests and the engine's KV cache manager."""

    __slots__ = ("kv",)

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def known(self, request: Request) -> int:
        return request.num_tokens

    def computed(self, request: Request) -> int:
        return request.num_computed_tokens

    def drafts(self, request: Request) -> int:
        return len(request.draft_token_ids)

    def is_running(self, request: Request) -> bool:
        return request.status is RequestStatus.RUNNING

    def priority(self, request: Request) -> int:
        return request.params.priority

    def grow(self, request: Request, num_tokens: int) -> bool:
        return self.kv.allocate(request.request_id, num_tokens)

    def cached_prefix(self, request: Request) -> tuple[int, CachedPrefix]:
        cached = self.kv.find_cached_prefix(request.request_id, request.token_ids, request.extra_key)
        return cached.num_tokens, cached

    def admit(self, request: Request, hits: CachedPrefix, num_tokens: int) -> int | None:
        if not self.kv.allocate(request.request_id, num_tokens, hits):
            return None
        cached = hits.num_tokens  # after allocating: less the tier blocks that failed to load
        if not request.admitted:
            request.num_cached_tokens, request.admitted = cached, True
        request.num_computed_tokens = cached
        request.status = RequestStatus.RUNNING
        return cached

    def preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING


class Scheduler:
    """The engine's queues over its KV cache manager; each step planned by `step_policy`."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._book = _RequestBook(kv)
        self.prioritized: set[str] = set()  # its requests with a priority other than 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self._note_priority(request)

    def run_imported(self, request: Request) -> None:
        """A request whose KV was imported from another worker, decoding from the next step."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._note_priority(request)

    def _note_priority(self, request: Request) -> None:
        if request.params.priority:  # the step policy reads priorities only while one is set
            self.prioritized.add(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str, free_kv: bool = True) -> None:
        """End a request in any state and release its blocks (unless the caller keeps them)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        self.prioritized.discard(request.request_id)
        if free_kv:
            self.kv.free(request.request_id)

    def abort(self, request: Request) -> None:
        self.finish(request, FINISH_ABORT)

    def schedule(self) -> SchedulerOutput:
        step = plan_step(self._book, self.waiting, self.running, self.config, mixed=bool(self.prioritized))
        return SchedulerOutput([ScheduledSeq(request, start, n) for request, start, n in step.chunks],
                               [request.request_id for request in step.preempted])

    def advance(self, seq: ScheduledSeq) -> None:
        """Record what the step computed for `seq`, its sampled tokens already appended: every
        position before the newest token holds verified K/V (a rejected draft's does not count,
        and its blocks go back to the pool); filled blocks enter the prefix cache."""
        request = seq.request
        request.num_computed_tokens = min(seq.start + seq.num_tokens, request.num_tokens - 1) \
            if seq.samples else seq.start + seq.num_tokens
        if seq.num_drafts:
            self.kv.trim(request.request_id, request.num_tokens)
        self.kv.cache_computed(request.request_id, request.token_ids, request.num_computed_tokens)
