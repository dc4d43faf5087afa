"""Continuous batching, prefix caching and preemption never change greedy outputs."""
from pathlib import Path

from tests.engine.helpers import GREEDY, make_engine, prompts
from tokenmill.textgen.sampling import SamplingParams


def _assert_idle(engine) -> None:
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
    assert engine.kv.num_live_requests() == 0
    assert not engine.requests


def test_batched_equals_alone(tiny_moe: Path) -> None:
    engine = make_engine(tiny_moe, max_num_batched_tokens=128)
    batch = prompts(engine, 16, seed=3)
    together = engine.generate(batch, GREEDY)
    alone = [make_engine(tiny_moe, enable_prefix_caching=False).generate([p], GREEDY)[0] for p in batch]
    assert together == alone
    _assert_idle(engine)


def test_prefix_cache_hit_gives_the_cold_output(tiny_dense: Path) -> None:
    engine = make_engine(tiny_dense)
    prompt = prompts(engine, 1, seed=4, low=100, high=101)[0]
    cold = engine.generate([prompt], GREEDY)[0]
    hits_before = engine.kv.stats.hit_tokens
    warm = engine.generate([prompt], GREEDY)[0]
    assert engine.kv.stats.hit_tokens - hits_before >= 96
    assert warm == cold
    # A sibling sharing the first 64 tokens reuses them and matches its own cold run.
    sibling = prompt[:64] + prompts(engine, 1, seed=5, low=30, high=31)[0]
    assert engine.generate([sibling], GREEDY)[0] == make_engine(tiny_dense).generate([sibling], GREEDY)[0]
    _assert_idle(engine)


def test_preemption_finishes_everything_with_identical_output(tiny_moe: Path) -> None:
    batch = prompts(make_engine(tiny_moe), 12, seed=6, low=20, high=60)
    roomy = make_engine(tiny_moe).generate(batch, GREEDY)
    tight = make_engine(tiny_moe, num_kv_blocks=24)  # 384 slots for ~12 x 100 tokens
    assert tight.generate(batch, GREEDY) == roomy
    assert tight.stats().num_preemptions > 0
    _assert_idle(tight)


def test_abort_frees_blocks_mid_generation(tiny_dense: Path) -> None:
    engine = make_engine(tiny_dense)
    for i, p in enumerate(prompts(engine, 4, seed=7)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.abort("r1") and engine.abort("r3")
    assert not engine.abort("r1")
    while engine.has_unfinished():
        engine.step()
    _assert_idle(engine)
