"""`StepProfiler`: every step counted under its kind, every class non-negative, and nothing of
it left on the engine afterwards (no hooks, no wrapped methods)."""
from __future__ import annotations

from pathlib import Path

from tests.engine.helpers import make_engine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.step_profile import CLASSES, StepProfiler
from tokenmill.textgen.sampling import SamplingParams


def _hooks(engine: LLMEngine) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in engine.runner.model.modules())


def test_steps_are_split_by_kind_and_the_engine_is_left_as_it_was(tiny_moe: Path) -> None:
    engine = make_engine(tiny_moe)
    before = engine.stats()
    with StepProfiler(engine) as profiler:
        assert _hooks(engine) > 0
        engine.generate([[5, 6, 7] * 10, [9] * 40], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    after = engine.stats()
    decode, prefill = profiler.breakdown["decode"], profiler.breakdown["prefill"]
    assert decode.steps == after.num_decode_only_steps - before.num_decode_only_steps > 0
    assert decode.steps + prefill.steps == after.num_steps - before.num_steps
    for part in (decode, prefill):
        assert set(part.seconds) == set(CLASSES) and all(s >= 0 for s in part.seconds.values())
        assert part.seconds["experts"] > 0 and part.seconds["attention"] > 0 and part.seconds["sampling"] > 0
    assert prefill.seconds["inputs"] > 0 and prefill.seconds["scheduling"] > 0
    assert _hooks(engine) == 0
    assert not {"step"} & engine.__dict__.keys() and "schedule" not in engine.scheduler.__dict__
    assert not {"execute", "_prepare"} & engine.runner.__dict__.keys()
