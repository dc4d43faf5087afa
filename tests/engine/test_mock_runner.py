"""The mock runner keeps the real scheduler: same decisions as the torch runner, and steps
priced by a clock from each step's real shape (the simulator's, with --mock-profile)."""
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.engine.helpers import make_engine, prompts
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.mock_runner import StepTimeModel, step_work
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.sim.fleet.clock import StepClock
from tokenmill.step_work import StepWork
from tokenmill.textgen.sampling import SamplingParams

PROFILE = "llama-3.1-8b@h100:fp8:tp1"


def _trace(engine, batch) -> list[list[tuple[str, int, int]]]:
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True))
    steps: list[list[tuple[str, int, int]]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append([(s.request.request_id, s.start, s.num_tokens) for s in out.seqs])
        return out

    engine.scheduler.schedule = recording_schedule
    while engine.has_unfinished():
        engine.step()
    return steps


def test_mock_and_torch_make_the_same_scheduling_decisions(tiny_moe: Path) -> None:
    small = dict(num_kv_blocks=20, max_num_batched_tokens=64, enable_prefix_caching=False)
    torch_engine = make_engine(tiny_moe, **small)
    batch = prompts(torch_engine, 10, seed=13, low=10, high=90)
    mock_engine = make_engine(tiny_moe, runner="mock", mock_sleep=False, **small)
    torch_steps, mock_steps = _trace(torch_engine, batch), _trace(mock_engine, batch)
    assert torch_steps == mock_steps
    assert torch_engine.stats().num_preemptions == mock_engine.stats().num_preemptions > 0


def test_mock_step_time_follows_the_model_and_tokens_are_deterministic(tiny_moe: Path) -> None:
    coeffs = StepTimeModel(a=0.001, b=1e-5, c=1e-4, d=1e-7)
    engine = make_engine(tiny_moe, runner="mock", mock_sleep=False, mock_step_time=coeffs)
    batch = prompts(engine, 3, seed=14)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = engine.generate(batch, params)
    assert first == make_engine(tiny_moe, runner="mock", mock_sleep=False).generate(batch, params)
    assert all(t not in engine.tokenizer.special_token_ids for out in first for t in out)
    stats = engine.stats()
    expected = coeffs.a * stats.num_steps + coeffs.b * stats.prefill_tokens + coeffs.c * stats.decode_tokens
    assert engine.runner.modelled_seconds >= expected  # plus the d * kv_tokens_read term
    assert engine.runner.modelled_seconds <= expected + coeffs.d * 10_000


@dataclass(slots=True)
class RecordingClock:
    """Prices steps with `clock` and keeps what it priced."""
    clock: StepClock
    works: list[StepWork] = field(default_factory=list)

    def seconds(self, work: StepWork) -> float:
        self.works.append(work)
        return self.clock.seconds(work)


def _request(rid: str, prompt_len: int, generated: int = 0) -> Request:
    request = Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=16))
    for t in range(generated):
        request.append_token(7 + t, None)
    return request


def test_step_work_counts_a_known_schedule_exactly() -> None:
    decode = _request("d", 10, generated=2)  # 12 tokens, computing the last: position 11
    middle = _request("m", 40)  # a prefill chunk that does not reach the end: no sample
    last = _request("l", 20)  # the final chunk of a prompt: samples its first token
    out = SchedulerOutput([ScheduledSeq(decode, 11, 1), ScheduledSeq(middle, 16, 16), ScheduledSeq(last, 16, 4)])
    expected = StepWork(prefill_tokens=20,
                        prefill_attended=16 * (16 + 17 / 2) + 4 * (16 + 5 / 2),  # 392 + 74
                        prefill_kv_tokens=32 + 20, decode_seqs=1, decode_kv_tokens=12, sampled=2)
    assert step_work(out) == expected
    assert step_work(out).kv_tokens_read == out.kv_tokens_read  # the linear model's figures are kept
    coeffs = StepTimeModel(a=1.0, b=2.0, c=3.0, d=4.0)
    assert coeffs.seconds(step_work(out)) == 1.0 + 2.0 * 20 + 3.0 * 1 + 4.0 * (52 + 12)


def test_mock_runner_is_clocked_by_the_simulator_from_each_steps_real_shape(tiny_moe: Path) -> None:
    clock = RecordingClock(StepClock.from_text(PROFILE))
    engine = make_engine(tiny_moe, runner="mock", mock_sleep=False, mock_step_time=clock,
                         max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 13)), params)  # 10 tokens: one step
    engine.step()
    engine.add_request("b", list(range(3, 28)), params)  # 25 tokens: chunks of 15 and 10 beside a's decodes
    while engine.has_unfinished():
        engine.step()
    first, second, third = clock.works[:3]
    assert first == StepWork(10, StepWork.chunk_attended(0, 10), 10, 0, 0, 1)
    assert second == StepWork(15, StepWork.chunk_attended(0, 15), 15, 1, 11, 1)
    assert third == StepWork(10, StepWork.chunk_attended(15, 10), 25, 1, 12, 2)
    assert len(clock.works) == engine.stats().num_steps
    assert engine.runner.modelled_seconds == pytest.approx(sum(clock.clock.seconds(w) for w in clock.works),
                                                           rel=1e-12)
    assert engine.runner.modelled_seconds > 0


def test_speedup_scales_the_wait_but_not_the_modelled_time(tiny_moe: Path) -> None:
    coeffs = StepTimeModel(a=0.02, b=0.0, c=0.0, d=0.0)
    engine = make_engine(tiny_moe, runner="mock", mock_step_time=coeffs, mock_speedup=10.0)
    batch = prompts(engine, 2, seed=15, low=5, high=30)
    started = time.perf_counter()
    engine.generate(batch, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - started
    steps = engine.stats().num_steps
    assert engine.runner.modelled_seconds == pytest.approx(0.02 * steps)  # unscaled model time
    assert wall >= engine.runner.modelled_seconds / 10  # a lower bound only: the machine may be slow
    # the engine's busy time is the steps' time as played, even when the waits are left to its loop
    assert engine.stats().busy_seconds == pytest.approx(0.02 * steps / 10)


def test_a_deferred_wait_still_counts_the_steps_time_as_busy(tiny_moe: Path) -> None:
    engine = make_engine(tiny_moe, runner="mock", mock_step_time=StepTimeModel(a=0.5, b=0.0, c=0.0, d=0.0))
    engine.runner.defer_waits = True  # as the async engine runs it: the loop waits, not the step
    engine.generate(prompts(engine, 1, seed=16, low=5, high=10), SamplingParams(max_tokens=4, temperature=0.0,
                                                                                ignore_eos=True))
    steps = engine.stats().num_steps
    assert engine.stats().busy_seconds == pytest.approx(0.5 * steps)  # the model's time, not the host's
    assert engine.runner.take_step_end() is not None  # the last step's wait was left to the caller


@pytest.mark.parametrize("speedup", [0.0, -1.0, float("nan"), float("inf")])
def test_mock_speedup_must_be_positive(tiny_moe: Path, speedup: float) -> None:
    with pytest.raises(ValueError, match="mock_speedup"):
        EngineConfig(model=str(tiny_moe), runner="mock", mock_speedup=speedup)


def test_mock_runner_honours_a_grammar(tiny_moe: Path) -> None:
    """A mock fleet serving structured outputs must still answer with what the grammar allows."""
    import json

    import llguidance

    schema = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
              "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "integer", "minimum": 0, "maximum": 50}}}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    engine = make_engine(tiny_moe, runner="mock", mock_sleep=False)
    batch = prompts(engine, 4, seed=3)
    outputs = engine.generate(batch, SamplingParams(max_tokens=40, grammar=grammar))
    for tokens in outputs:
        value = json.loads(engine.tokenizer.decode(tokens))
        assert value["a"] in ("x", "y") and 0 <= value["b"] <= 50
