"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget. Running decodes are scheduled first (one token
each), then running prefills continue, then waiting requests are admitted, each
prefill taking at most what is left of the budget (so a long prompt is cut into
chunks and never stalls decodes for more than one chunk). When the pool cannot
hold the next tokens, the latest-arrived request not yet scheduled this step is
preempted: its blocks are freed (they stay in the prefix cache) and it returns to
the front of the queue to be recomputed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.kv.cache_manager import KVCacheManager
from tokenmill.textgen.outputs import FINISH_ABORT


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    start: int  # first position computed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's known tokens."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        # a continued request's prompt ends with tokens generated elsewhere: past the client's prompt
        client_prompt = self.request.num_prompt_tokens - self.request.output_offset
        return self.num_tokens == 1 and self.start >= client_prompt


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


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str, free_kv: bool = True) -> None:
        """End a request in any state and release its blocks (unless the caller keeps them)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        if free_kv:
            self.kv.free(request.request_id)

    def abort(self, request: Request) -> None:
        self.finish(request, FINISH_ABORT)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if request.status is not RequestStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this loop
            budget -= self._schedule_running(request, budget, out)
        if not out.preempted:
            self._admit_waiting(budget, out)
        return out

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        while not self.kv.allocate(request.request_id, request.num_computed_tokens + n):
            scheduled = {s.request.request_id for s in out.seqs}  # only here: per request it made steps O(batch²)
            victims = [r for r in self.running if r.request_id not in scheduled and r is not request]
            victim = victims[-1] if victims else request
            self._preempt(victim, out)
            if victim is request:
                return 0
        out.seqs.append(ScheduledSeq(request, request.num_computed_tokens, n))
        return n

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request.request_id, request.token_ids, request.extra_key)
            n = min(request.num_tokens - cached.num_tokens, budget)
            if not self.kv.allocate(request.request_id, cached.num_tokens + n, cached):
                break
            self.waiting.popleft()
            if not request.admitted:
                request.num_cached_tokens, request.admitted = cached.num_tokens, True
            request.num_computed_tokens = cached.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.seqs.append(ScheduledSeq(request, cached.num_tokens, n))
            budget -= n

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        out.preempted.append(request.request_id)

    def advance(self, out: SchedulerOutput) -> None:
        """Record what the step computed; filled blocks enter the prefix cache."""
        for seq in out.seqs:
            request = seq.request
            request.num_computed_tokens = seq.start + seq.num_tokens
            self.kv.cache_computed(request.request_id, request.token_ids, request.num_computed_tokens)
