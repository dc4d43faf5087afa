"""The scheduling policy of one step of continuous batching: which sequences compute how many
tokens, who is admitted and who is preempted. The engine's `Scheduler` and the fleet simulator's
`SimWorker` both call it, each over its own sequences and its own block pool (`StepBook`).

    step = plan_step(book, waiting, running, config)   # config: max_num_seqs, max_num_batched_tokens
    for seq, start, num_tokens in step.chunks: ...compute positions [start, start + num_tokens)...
    step.preempted                           # lost their blocks, now at the front of `waiting`

Every sequence has a priority (`book.priority`, lower is more urgent: a tenant's class). The
caller says whether any of its sequences has one other than 0 (`mixed`): if none has, the rules
below are first come, first served, and the policy never reads a priority nor scans `waiting`
(a simulated queue may hold tens of thousands). In order (`waiting` is a FIFO; `running` is in
admission order):
0. When the most urgent waiting sequence is more urgent than a running one and `max_num_seqs`
   run, the least urgent running sequence (the latest admitted among those) is preempted to
   make room for it: one a step, for the one slot it needs.
1. Running sequences with one uncomputed token (decodes) first, then those with more (prefills),
   each group by priority, then in `running` order; each computes min(its uncomputed tokens, the
   step's budget left), so a long prompt is cut into chunks and never stalls decodes for more
   than one chunk. Prefills less urgent than the most urgent waiting sequence come after
   admission (rule 3): a less urgent prompt never holds a more urgent one's first token back by
   more than the one step's chunk it had started. A decode with speculative drafts also computes
   as many of them as the budget left allows, when the pool holds them without preempting anyone
   (else it decodes its one token).
2. When the pool cannot hold a running sequence's next tokens, the least urgent running sequence
   not yet scheduled this step, the latest admitted among those (the sequence itself if there is
   no other), is preempted: `book.preempt` frees its blocks (they stay in the prefix cache), and
   it moves to the front of `waiting`, to be recomputed.
3. Unless rule 2 preempted, waiting sequences are admitted, the most urgent first and in order
   among equals, while budget is left and fewer than `max_num_seqs` run: each starts after its
   cached prefix and computes what is left of the budget. The first one the pool cannot hold
   stops admission (no overtaking).

`plan_step` changes `waiting` and `running` and, through the book, the sequences and the pool;
the caller records what the step computed once it has run (the engine's `advance`, the
simulator's `complete`).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
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

    def priority(self, seq: S) -> int:
        """Lower is more urgent (0: the default)."""

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


def plan_step(book: StepBook[S], waiting: deque[S], running: list[S], limits: StepLimits,
              mixed: bool = False) -> PlannedStep[S]:
    step: PlannedStep[S] = PlannedStep()
    urgency = book.priority if mixed else _first_come
    most_urgent_waiting = min(map(urgency, waiting), default=None) if mixed else None
    if most_urgent_waiting is not None:
        _make_room(book, most_urgent_waiting, waiting, running, limits, step)
    making_room = len(step.preempted)
    budget = limits.max_num_batched_tokens
    decodes = [s for s in running if book.known(s) - book.computed(s) == 1]
    prefills = [s for s in running if book.known(s) - book.computed(s) > 1]
    before = prefills
    if mixed:
        decodes.sort(key=urgency)
        prefills.sort(key=urgency)
        before = [s for s in prefills if most_urgent_waiting is None or urgency(s) <= most_urgent_waiting]
    for seq in decodes + before:
        budget = _schedule(book, urgency, seq, budget, waiting, running, step)
    if len(step.preempted) == making_room:
        budget = _admit_waiting(book, urgency, budget, waiting, running, limits, step)
    for seq in prefills[len(before):]:
        budget = _schedule(book, urgency, seq, budget, waiting, running, step)
    return step


def _first_come(seq: object) -> int:
    return 0


def _make_room(book: StepBook[S], most_urgent_waiting: int, waiting: deque[S], running: list[S],
               limits: StepLimits, step: PlannedStep[S]) -> None:
    """Rule 0: the least urgent running sequence gives its place to a more urgent waiting one."""
    if running and len(running) >= limits.max_num_seqs:
        victim = _least_urgent(book.priority, running)
        if book.priority(victim) > most_urgent_waiting:
            _preempt(book, victim, waiting, running, step)


def _least_urgent(urgency: Callable[[S], int], candidates: list[S]) -> S:
    """The least urgent of `candidates` (in admission order), the latest admitted among equals."""
    return max(enumerate(candidates), key=lambda pair: (urgency(pair[1]), pair[0]))[1]


def _preempt(book: StepBook[S], victim: S, waiting: deque[S], running: list[S], step: PlannedStep[S]) -> None:
    running.remove(victim)
    book.preempt(victim)
    waiting.appendleft(victim)
    step.preempted.append(victim)


def _schedule(book: StepBook[S], urgency: Callable[[S], int], seq: S, budget: int, waiting: deque[S],
              running: list[S], step: PlannedStep[S]) -> int:
    """A running sequence's chunk, if budget is left and it was not preempted earlier in the
    step: the budget left after it."""
    if budget == 0 or not book.is_running(seq):
        return budget
    return budget - _schedule_running(book, urgency, seq, budget, waiting, running, step)


def _schedule_running(book: StepBook[S], urgency: Callable[[S], int], seq: S, budget: int, waiting: deque[S],
                      running: list[S], step: PlannedStep[S]) -> int:
    n = min(book.known(seq) - book.computed(seq), budget)
    drafts = min(book.drafts(seq), budget - 1) if n == 1 else 0
    if drafts and book.grow(seq, book.computed(seq) + 1 + drafts):
        step.chunks.append((seq, book.computed(seq), 1 + drafts))
        return 1 + drafts
    while not book.grow(seq, book.computed(seq) + n):
        scheduled = {id(chunk[0]) for chunk in step.chunks}  # only here: per sequence it made steps O(batch²)
        victims = [s for s in running if id(s) not in scheduled and s is not seq]
        victim = _least_urgent(urgency, victims) if victims else seq
        _preempt(book, victim, waiting, running, step)
        if victim is seq:
            return 0
    step.chunks.append((seq, book.computed(seq), n))
    return n


def _admit_waiting(book: StepBook[S], urgency: Callable[[S], int], budget: int, waiting: deque[S],
                   running: list[S], limits: StepLimits, step: PlannedStep[S]) -> int:
    """Rule 3: the budget left after admission."""
    while waiting and budget > 0 and len(running) < limits.max_num_seqs:
        seq = waiting[0] if urgency is _first_come else min(waiting, key=urgency)  # the first of the most urgent
        cached, hits = book.cached_prefix(seq)
        n = min(book.known(seq) - cached, budget)
        start = book.admit(seq, hits, cached + n)
        if start is None:
            break
        if seq is waiting[0]:
            waiting.popleft()
        else:
            waiting.remove(seq)
        running.append(seq)
        step.chunks.append((seq, start, n))
        budget -= n
    return budget
