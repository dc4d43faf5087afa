"""Each engine step's time, shared out over the requests in it by the tokens each computed: what a
tenant is charged. The shares add up to the steps' time, and a request's outputs carry its share."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from tests.engine.helpers import make_engine, prompts
from tokenmill.textgen.sampling import SamplingParams


@pytest.mark.parametrize("runner", ["torch", "mock"])
def test_the_requests_shares_add_up_to_the_engines_step_time(tiny_dense: Path, runner: str) -> None:
    engine = make_engine(tiny_dense, runner=runner, max_num_batched_tokens=64)
    batch = prompts(engine, 6, seed=3, low=5, high=150)  # long prompts span several chunked steps
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8 + i, ignore_eos=True, temperature=0))
    shares: dict[str, float] = defaultdict(float)
    while engine.has_unfinished():
        for out in engine.step():
            shares[out.request_id] += out.step_seconds
    stats = engine.stats()
    assert sum(shares.values()) == pytest.approx(stats.prefill_step_seconds + stats.decode_step_seconds, rel=1e-9)
    assert len(shares) == 6 and all(seconds > 0 for seconds in shares.values())
