"""One simulated worker: the engine's scheduling policy over a `SimKV`, one step at a time.

`schedule` is `tokenmill.step_policy.plan_step`, the policy the engine's `Scheduler` follows, so
a simulated worker batches exactly as a live (mock) worker does: running decodes first (one
token each), then running prefills, then waiting requests admitted while `max_num_seqs` and the
step's token budget allow (chunked prefill); when the pool is short, the latest-admitted request
not yet scheduled this step is preempted (its blocks freed, still cached) and goes back to the
front of the queue. Only the representation differs: sequences without token ids, blocks keyed
by trace hashes (`cache.py`).

Disaggregation: a `prefill_only` sequence stops after its first token and its blocks are
*held* until its decode worker has pulled them (`release`); the decode side admits a pulled
request with `begin_import` (local hits first, fresh blocks for the rest) and `finish_import`.

The worker knows no time: the fleet loop (`fleet.py`) asks for a batch, prices its
`StepWork` with the profile's clock, and calls `complete` when the step's time has passed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenmill.kv.events import KVEventEmitter
from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE
from tokenmill.sim.fleet.cache import SeqBlocks, SimKV
from tokenmill.step_policy import plan_step
from tokenmill.step_work import StepWork, work_of


@dataclass(slots=True, frozen=True)
class WorkerConfig:
    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"worker: field {name} must be >= 1")


@dataclass(slots=True, eq=False)  # an entity: compared by identity
class SimSeq:
    request_id: str
    prompt_tokens: int
    output_tokens: int  # tokens the request generates in all (on every worker together)
    kv: SeqBlocks
    num_tokens: int = 0  # known tokens: prompt + generated
    computed: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    admitted: bool = False
    running: bool = False
    prefill_only: bool = False
    finished: bool = False
    preemptions: int = 0
    priority: int = 0  # lower is more urgent (step_policy)

    def __post_init__(self) -> None:
        self.num_tokens = self.num_tokens or self.prompt_tokens

    @property
    def generated(self) -> int:
        return self.num_tokens - self.prompt_tokens


@dataclass(slots=True)
class Chunk:
    seq: SimSeq
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start >= self.seq.prompt_tokens


@dataclass(slots=True)
class Batch:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: int = 0
    reserved: int = 0  # blocks promised to this batch's decode run (taken when it ends)

    def work(self) -> StepWork:
        """The step's shape, built by the same function the mock runner prices its steps with."""
        return work_of(self.chunks)


class _SeqBook:
    """The step policy's view of simulated sequences and a `SimKV`."""

    __slots__ = ("kv",)

    def __init__(self, kv: SimKV) -> None:
        self.kv = kv

    def known(self, seq: SimSeq) -> int:
        return seq.num_tokens

    def computed(self, seq: SimSeq) -> int:
        return seq.computed

    def drafts(self, seq: SimSeq) -> int:
        return 0  # speculation is priced in the step-time model (accepted tokens per step), not drafted

    def is_running(self, seq: SimSeq) -> bool:
        return seq.running

    def priority(self, seq: SimSeq) -> int:
        return seq.priority

    def grow(self, seq: SimSeq, num_tokens: int) -> bool:
        return self.kv.allocate(seq.kv, num_tokens)

    def cached_prefix(self, seq: SimSeq) -> tuple[int, list[int]]:
        hits = self.kv.cached_prefix(seq.kv, seq.num_tokens)
        return len(hits) * self.kv.block_size, hits

    def admit(self, seq: SimSeq, hits: list[int], num_tokens: int) -> int | None:
        if not self.kv.allocate(seq.kv, num_tokens, hits):
            return None
        cached = len(hits) * self.kv.block_size
        if not seq.admitted:
            seq.cached_tokens, seq.admitted = cached, True
        seq.computed, seq.running = cached, True
        return cached

    def preempt(self, seq: SimSeq) -> None:
        self.kv.free(seq.kv)
        seq.computed, seq.running = 0, False
        seq.preemptions += 1


class SimWorker:
    def __init__(self, worker_id: str, role: str, config: WorkerConfig, events: KVEventEmitter | None = None) -> None:
        self.worker_id = worker_id
        self.role = role  # "agg", "prefill" or "decode"
        self.config = config
        self.kv = SimKV(config.num_blocks, config.block_size, events)
        self._book = _SeqBook(self.kv)
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.held: dict[str, SimSeq] = {}
        self.importing: dict[str, SimSeq] = {}
        self.prioritized: set[str] = set()  # its sequences with a priority other than 0 (step_policy)

    def add(self, seq: SimSeq) -> None:
        self.waiting.append(seq)
        self._note_priority(seq)

    def _note_priority(self, seq: SimSeq) -> None:
        if seq.priority:  # the step policy reads priorities only while one is set
            self.prioritized.add(seq.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling: the engine's policy (`tokenmill.step_policy`) ------------------------------

    def schedule(self) -> Batch:
        step = plan_step(self._book, self.waiting, self.running, self.config, mixed=bool(self.prioritized))
        return Batch([Chunk(seq, start, n) for seq, start, n in step.chunks], len(step.preempted))

    # ---- the end of a step ------------------------------------------------------------------

    def plan_decode_run(self, batch: Batch, max_steps: int) -> int:
        """How many identical steps `batch` can run back to back (see `replica.py`), their blocks reserved.

        Only a batch of decodes alone qualifies: nothing waiting could be admitted until a sequence
        finishes (the run's last step) or an outside event truncates the run.
        """
        if batch.preempted or not all(c.is_decode for c in batch.chunks):
            return 1
        steps = min(max_steps, min(c.seq.output_tokens - c.seq.generated for c in batch.chunks))
        while steps > 1 and not self.kv.reserve(self._blocks_for(batch, steps)):
            steps //= 2
        if steps > 1:
            batch.reserved = self._blocks_for(batch, steps)
        return max(steps, 1)

    def _blocks_for(self, batch: Batch, steps: int) -> int:
        bs = self.config.block_size
        return sum(max(0, -(-(c.start + steps) // bs) - len(c.seq.kv.blocks)) for c in batch.chunks)

    def complete(self, batch: Batch, steps: int = 1) -> list[SimSeq]:
        """Record what the step (or a run of `steps` decode steps) computed; the sequences that
        produced tokens, in batch order."""
        self.kv.reserved -= batch.reserved
        batch.reserved = 0
        sampled: list[SimSeq] = []
        for c in batch.chunks:
            seq = c.seq
            if not seq.running:
                continue
            if steps > 1 and not self.kv.allocate(seq.kv, c.start + steps):
                raise RuntimeError(f"{self.worker_id}: a decode run's reserved blocks were gone")
            seq.computed = c.start + c.num_tokens + steps - 1
            self.kv.cache_computed(seq.kv, seq.computed)
            if c.samples:
                seq.num_tokens += steps
                sampled.append(seq)
                if seq.generated >= seq.output_tokens or seq.prefill_only:
                    self._finish(seq)
        return sampled

    def _finish(self, seq: SimSeq) -> None:
        self.running.remove(seq)
        self.prioritized.discard(seq.request_id)
        seq.running, seq.finished = False, True
        if seq.prefill_only:
            self.held[seq.request_id] = seq  # its KV waits for the decode worker's pull
        else:
            self.kv.free(seq.kv)

    # ---- disaggregation ---------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        """The decode worker pulled a held request's KV: free its blocks (they stay cached)."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq.kv)

    def begin_import(self, seq: SimSeq) -> int | None:
        """Admit a request prefilled elsewhere: tokens to pull, or None when the pool is full."""
        remote = seq.num_tokens - 1  # every position but the remotely sampled token
        hits = self.kv.cached_prefix(seq.kv, seq.num_tokens)
        if not self.kv.allocate(seq.kv, remote, hits):
            return None
        seq.cached_tokens, seq.admitted = len(hits) * self.config.block_size, True
        seq.computed = seq.cached_tokens
        self.importing[seq.request_id] = seq
        return remote - seq.computed

    def finish_import(self, request_id: str) -> None:
        seq = self.importing.pop(request_id)
        seq.computed = seq.num_tokens - 1
        self.kv.cache_computed(seq.kv, seq.computed)
        seq.running = True
        self.running.append(seq)
        self._note_priority(seq)
