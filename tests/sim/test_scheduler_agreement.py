"""The engine's scheduler and the fleet simulator's worker, driven by the same operations, make the
same decisions: the same chunks (request, start, tokens) each step, the same preemptions, the same
queues. Each side keeps its own sequences and block pool (the engine's `KVCacheManager` over
token ids, the simulator's `SimKV` over hashes) and both plan steps with `tokenmill.step_policy`,
so a rule changed on one side alone (in its book or its pool) makes them disagree here.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.cache_manager import KVCacheManager
from tokenmill.kv.hashing import block_hashes
from tokenmill.sim.fleet.cache import SeqBlocks
from tokenmill.sim.fleet.worker import SimSeq, SimWorker, WorkerConfig
from tokenmill.textgen.outputs import FINISH_LENGTH
from tokenmill.textgen.sampling import SamplingParams

BS = 4
PREFIXES = [[1000 + 37 * p + i for i in range(24)] for p in range(3)]  # shared prompt starts: prefix hits

add_op = st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 24), st.integers(1, 30), st.integers(1, 12),
                   st.integers(-1, 1))  # the last: the request's priority (a tenant's class)
step_op = st.tuples(st.just("step"), st.integers(1, 8))
operations = st.lists(st.one_of(add_op, step_op), min_size=1, max_size=40)
limits = st.tuples(st.integers(6, 40), st.integers(1, 6), st.integers(4, 48))  # blocks, max seqs, token budget


class Engine:
    """The engine's `Scheduler` stepped as `LLMEngine.step` steps it, a made-up token per sample."""

    def __init__(self, num_blocks: int, max_seqs: int, budget: int) -> None:
        self.scheduler = Scheduler(SchedulerConfig(max_seqs, budget), KVCacheManager(BlockPool(num_blocks, BS)))
        self.wanted: dict[str, int] = {}

    def add(self, request_id: str, prompt: list[int], output_tokens: int, priority: int = 0) -> None:
        self.wanted[request_id] = output_tokens
        self.scheduler.add(Request(request_id, prompt, SamplingParams(max_tokens=output_tokens, priority=priority)))

    def step(self) -> tuple[list[tuple[str, int, int]], list[str]]:
        out = self.scheduler.schedule()
        for seq in out.seqs:
            request = seq.request
            if seq.samples:  # a token no other request generates: generated blocks are never shared
                request.append_token(hash((request.request_id, request.num_tokens)) % 30_000 + 5_000, None)
            self.scheduler.advance(seq)
            if seq.samples and len(request.output_token_ids) >= self.wanted[request.request_id]:
                self.scheduler.finish(request, FINISH_LENGTH)
        return [(s.request.request_id, s.start, s.num_tokens) for s in out.seqs], out.preempted

    def queues(self) -> tuple[list[str], list[str]]:
        return [r.request_id for r in self.scheduler.waiting], [r.request_id for r in self.scheduler.running]


class Simulated:
    """A `SimWorker` given each request's prompt as its chained block hashes."""

    def __init__(self, num_blocks: int, max_seqs: int, budget: int) -> None:
        self.worker = SimWorker("w", "agg", WorkerConfig(num_blocks, BS, max_seqs, budget))

    def add(self, request_id: str, prompt: list[int], output_tokens: int, priority: int = 0) -> None:
        blocks = SeqBlocks(block_hashes(prompt, BS), salt=hash(request_id) & (2**63 - 1))
        self.worker.add(SimSeq(request_id, len(prompt), output_tokens, blocks, priority=priority))

    def step(self) -> tuple[list[tuple[str, int, int]], int]:
        batch = self.worker.schedule()
        self.worker.complete(batch)
        return [(c.seq.request_id, c.start, c.num_tokens) for c in batch.chunks], batch.preempted

    def queues(self) -> tuple[list[str], list[str]]:
        return [s.request_id for s in self.worker.waiting], [s.request_id for s in self.worker.running]


@settings(max_examples=300, deadline=None)
@given(limits, operations)
def test_the_engine_and_the_simulator_schedule_alike(sizes: tuple[int, int, int],
                                                      ops: list[tuple[int | str, ...]]) -> None:
    engine, simulated = Engine(*sizes), Simulated(*sizes)
    for index, op in enumerate(ops):
        if op[0] == "add":
            _, prefix, shared, unique, output_tokens, priority = op
            prompt = PREFIXES[prefix][:shared] + [20_000 + 97 * index + i for i in range(unique)]
            for side in (engine, simulated):
                side.add(f"r{index}", prompt, output_tokens, priority)
            continue
        for _ in range(op[1]):
            chunks, preempted = engine.step()
            sim_chunks, sim_preempted = simulated.step()
            assert chunks == sim_chunks
            assert len(preempted) == sim_preempted
            assert engine.queues() == simulated.queues()


def test_a_full_pool_preempts_the_latest_admitted_on_both_sides() -> None:
    """A hand-checked case: 4 blocks of 4 tokens; two 7-token prompts fill them, and the first
    decode that needs a third block each preempts the later request, which waits to recompute."""
    engine, simulated = Engine(4, 4, 64), Simulated(4, 4, 64)
    for side in (engine, simulated):
        side.add("a", list(range(1, 8)), 10)
        side.add("b", list(range(101, 108)), 10)
    first = ([("a", 0, 7), ("b", 0, 7)], [])
    assert engine.step() == first and simulated.step() == (first[0], 0)
    second = ([("a", 7, 1), ("b", 7, 1)], [])  # positions 7: still inside each request's second block
    assert engine.step() == second and simulated.step() == (second[0], 0)
    third_engine, third_sim = engine.step(), simulated.step()  # position 8 needs a third block: b goes
    assert third_engine == ([("a", 8, 1)], ["b"]) and third_sim == ([("a", 8, 1)], 1)
    assert engine.queues() == simulated.queues() == (["b"], ["a"])


def test_an_urgent_request_takes_the_place_of_the_latest_less_urgent_one_on_both_sides() -> None:
    """Two slots held by batch requests (priority 1); an interactive one (-1) arrives: the later
    batch request is preempted in the next step and the interactive one admitted in its place."""
    engine, simulated = Engine(64, 2, 64), Simulated(64, 2, 64)
    for side in (engine, simulated):
        side.add("batch-1", list(range(1, 6)), 20, priority=1)
        side.add("batch-2", list(range(101, 106)), 20, priority=1)
        side.step()
        side.add("interactive", list(range(201, 204)), 5, priority=-1)
    chunks, preempted = engine.step()
    assert preempted == ["batch-2"] and ("interactive", 0, 3) in chunks and ("batch-1", 5, 1) in chunks
    assert simulated.step() == (chunks, 1)
    assert engine.queues() == simulated.queues() == (["batch-2"], ["batch-1", "interactive"])


def test_an_urgent_prompt_is_admitted_before_a_less_urgent_one_already_running_takes_the_budget() -> None:
    """A batch prompt mid-prefill (a 4-token budget) and an interactive one arriving: the next step
    admits the interactive prompt before the batch one's next chunk, and it keeps going first."""
    engine, simulated = Engine(64, 4, 4), Simulated(64, 4, 4)
    for side in (engine, simulated):
        side.add("batch", list(range(1, 13)), 3, priority=1)
        side.step()  # batch computes tokens 0-3
        side.add("interactive", list(range(101, 107)), 3, priority=-1)
    expected = [[("interactive", 0, 4)], [("interactive", 4, 2), ("batch", 4, 2)], [("interactive", 6, 1),
                                                                                      ("batch", 6, 3)]]
    for chunks in expected:
        assert engine.step() == (chunks, [])
        assert simulated.step() == (chunks, 0)
