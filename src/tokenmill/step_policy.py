"""The scheduling policy of one step of continuous batching: which sequences compute how many
tokens, who is admitted and who is preempted. The engine's `Scheduler` and the fleet simulator's
`SimWorker` both call it, each over its own sequences and its own block pool (`StepBook`).

    step = plan_step(book, waiting, running, config)   # config: max_num_seqs, max_num_batched_tokens
    for seq, start, num_tokens in step.chunks: ...compute positions [start, start + num_tokens)...
    step.preempted                           # lost their blocks, now at the front of `waiting`

The rules, in order (`waiting` is a FIFO; `running` is in admission order):
1. Running sequences with one uncomputed token (decodes) first, then those with more (prefills),
   each in `running` order; each computes min(its uncomputed tokens, the step's budget left),
   so a long prompt is cut into chunks and never stalls decodes for more than one chunk.
   A decode with speculative drafts also computes as many of them as the budget left allows,
   when the pool holds them without preempting anyone (else it decodes its one token).
2. When the pool cannot hold a running sequence's next tokens, the latest-admitted running
   sequence not yet scheduled this step (the sequence itself if there is no other) is preempted:
   `book.preempt` frees its blocks (they stay in the prefix cache), and it moves to the front of
   `waiting`, to be recomputed.
3. Only if nothing was preempted, waiting sequences are admitted in order while budget is left
   and fewer than `max_num_seqs` run: each starts after its cached prefix and computes what is
   left of the budget. The first one the pool cannot hold stops admission (no overtaking).

`plan_step` changes `waiting` and `running` and, through the book, the sequences and the pool;
the caller records what the step computed once it has run (the engine's `advance`, the
simulator's `complete`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

S = TypeVar("S")


class StepLimits(Protocol):
    """A step's limits, read from the caller's own config (the engine's `SchedulerConfig`, the
    simulator's `WorkerConfig`)."""

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...


@dataclass(slots=True)
class PlannedStep(Generic[S]):
    chunks: list[tuple[S, int, int]] = field(default_factory=list)  # (sequence, start, num_tokens)
    preempted: list[S] = field(default_factory=list)


class StepBook(Protocol[S]):
    """What the policy asks of one side's sequences and block pool."""

    def known(self, seq: S) -> int:
        """Its tokens so far: the prompt and what was generated."""

    def computed(self, seq: S) -> int:
        """Of those, the tokens whose K/V are in this worker's pool."""

    def drafts(self, seq: S) -> int:
        """Speculative tokens proposed after its known ones (0 without speculation)."""

    def is_running(self, seq: S) -> bool: ...

    def grow(self, seq: S, num_tokens: int) -> bool:
        """Blocks for the first `num_tokens` positions of a running sequence; False, changing
        nothing, when the pool is short."""

    def cached_prefix(self, seq: S) -> tuple[int, Any]:
        """(tokens, hits) of a waiting sequence's cached leading blocks."""

    def admit(self, seq: S, hits: Any, num_tokens: int) -> int | None:
        """Blocks for `num_tokens` positions, `hits` first, and the sequence runs: the tokens it
        has computed, where its chunk starts (fewer than the hits offered when a lower tier's
        block failed to load, so those are recomputed). None, changing nothing, when the pool
        is short."""

    def preempt(self, seq: S) -> None:
        """Free its blocks and reset it to recompute from the start."""


def plan_step(book: StepBook[S], waiting: deque[S], running: list[S], limits: StepLimits) -> PlannedStep[S]:
    step: PlannedStep[S] = PlannedStep()
    budget = limits.max_num_batched_tokens
    decodes = [s for s in running if book.known(s) - book.computed(s) == 1]
    prefills = [s for s in running if book.known(s) - book.computed(s) > 1]
    for seq in decodes + prefills:
        if budget == 0 or not book.is_running(seq):
            continue  # preempted earlier in this loop
        budget -= _schedule_running(book, seq, budget, waiting, running, step)
    if not step.preempted:
        _admit_waiting(book, budget, waiting, running, limits, step)
    return step


def _schedule_running(book: StepBook[S], seq: S, budget: int, waiting: deque[S], running: list[S],
                      step: PlannedStep[S]) -> int:
    n = min(book.known(seq) - book.computed(seq), budget)
    drafts = min(book.drafts(seq), budget - 1) if n == 1 else 0
    if drafts and book.grow(seq, book.computed(seq) + 1 + drafts):
        step.chunks.append((seq, book.computed(seq), 1 + drafts))
        return 1 + drafts
    while not book.grow(seq, book.computed(seq) + n):
        scheduled = {id(chunk[0]) for chunk in step.chunks}  # only here: per sequence it made steps O(batch²)
        victims = [s for s in running if id(s) not in scheduled and s is not seq]
        victim = victims[-1] if victims else seq
        running.remove(victim)
        book.preempt(victim)
        waiting.appendleft(victim)
        step.preempted.append(victim)
        if victim is seq:
            return 0
    step.chunks.append((seq, book.computed(seq), n))
    return n


def _admit_waiting(book: StepBook[S], budget: int, waiting: deque[S], running: list[S], limits: StepLimits,
                   step: PlannedStep[S]) -> None:
    while waiting and budget > 0 and len(running) < limits.max_num_seqs:
        seq = waiting[0]
        cached, hits = book.cached_prefix(seq)
        n = min(book.known(seq) - cached, budget)
        start = book.admit(seq, hits, cached + n)
        if start is None:
            break
        waiting.popleft()
        running.append(seq)
        step.chunks.append((seq, start, n))
        budget -= n
