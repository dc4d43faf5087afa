"""A long prompt arriving among running decodes is cut into chunks; decodes never skip a step."""
from pathlib import Path

from tests.engine.helpers import make_engine, prompts
from tokenmill.textgen.sampling import SamplingParams


def test_long_prompt_never_stalls_decodes(tiny_dense: Path) -> None:
    chunk_budget = 128
    engine = make_engine(tiny_dense, max_num_batched_tokens=chunk_budget)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(engine, 8, seed=8, low=10, high=30)):
        engine.add_request(f"d{i}", p, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    long_prompt = prompts(engine, 1, seed=9, low=1000, high=1001)[0]
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    prefill_steps = 0
    while engine.requests["long"].num_computed_tokens < len(long_prompt):
        decoding = [r for r in engine.requests.values() if r.request_id != "long"]
        before = {r.request_id: len(r.output_token_ids) for r in decoding}
        out = engine.scheduler.schedule()
        prefill = sum(s.num_tokens for s in out.seqs if s.request.request_id == "long")
        sampled = engine.runner.execute(out, engine.kv)
        engine._process(engine.scheduler, out, sampled)
        prefill_steps += 1
        assert 0 < prefill <= chunk_budget - len(decoding)
        for r in decoding:  # every running decode advanced in this very step
            assert len(r.output_token_ids) == before[r.request_id] + 1
    assert prefill_steps >= 1000 // chunk_budget
