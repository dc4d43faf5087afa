"""The mock runner keeps the real scheduler: same decisions as the torch runner."""
from pathlib import Path

from tests.engine.helpers import make_engine, prompts
from tokenmill.engine.mock_runner import StepTimeModel
from tokenmill.engine.sampling import SamplingParams


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
