"""The cost function: the module docstring's worked example, tier weights, ties and softmax sampling."""
from __future__ import annotations

import random

import pytest

from tokenmill.router.cost import CostConfig, choose, worker_terms
from tokenmill.router.load import WorkerLoad


def test_worked_example_costs_18_10_11_choose_the_second() -> None:
    # 10-block prompt; (cached, prefill, decode) = 2/8/10, 5/5/5, 8/2/9
    config = CostConfig()
    workers = [("w1", 2, 2.0), ("w2", 5, 0.0), ("w3", 8, 7.0)]  # (name, device overlap, active decode)
    terms = [worker_terms(name, 10, {"device": cached}, WorkerLoad(0.0, active_decode), config)
             for name, cached, active_decode in workers]
    assert [(t.prefill, t.decode, t.cost) for t in terms] == [(8, 10, 18), (5, 5, 10), (2, 9, 11)]
    index, reason, probability = choose(terms, 0.0, random.Random(0))
    assert terms[index].worker == "w2" and probability is None
    assert reason.startswith("lowest cost 10 (next best 11)") and "w2: cost 10" in reason


def test_tier_weights_prefill_weight_and_active_prefill() -> None:
    config = CostConfig(prefill_weight=2.0)
    overlap = {"device": 2, "host": 4, "disk": 4, "shared": 2}   # 2 + 3 + 1 + 1 = 7 cached
    terms = worker_terms("w", 10, overlap, WorkerLoad(prefill_blocks=5.0, decode_blocks=1.0), config)
    assert terms.cached_blocks == pytest.approx(7.0)
    assert terms.new_prefill == pytest.approx(3.0) and terms.prefill == pytest.approx(8.0)
    assert terms.request_decode == 8.0 and terms.decode == 9.0    # only device hits are shared
    assert terms.cost == pytest.approx(2.0 * 8.0 + 9.0)


def test_prefill_is_clamped_at_zero() -> None:
    # prompt_blocks counts a partial block the hashes never cover, so this cannot happen from a
    # real match, but the clamp is the contract
    terms = worker_terms("w", 3, {"device": 4}, WorkerLoad(), CostConfig())
    assert terms.new_prefill == 0.0 and terms.request_decode == 0.0


def test_ties_are_broken_at_random_with_the_injected_rng() -> None:
    config = CostConfig()
    terms = [worker_terms(w, 4, {}, WorkerLoad(), config) for w in ("a", "b", "c")]
    picks = {terms[choose(terms, 0.0, random.Random(seed))[0]].worker for seed in range(40)}
    assert picks == {"a", "b", "c"}
    first = choose(terms, 0.0, random.Random(7))
    assert first == choose(terms, 0.0, random.Random(7)) and "tie at cost 8" in first[1]


def test_temperature_samples_cheaper_workers_more_often() -> None:
    config = CostConfig()
    terms = [worker_terms("cheap", 10, {"device": 9}, WorkerLoad(), config),
             worker_terms("dear", 10, {}, WorkerLoad(), config)]
    rng = random.Random(1)
    picks = [choose(terms, 0.5, rng) for _ in range(2000)]
    cheap_share = sum(terms[i].worker == "cheap" for i, _, _ in picks) / len(picks)
    # normalised costs 0 and 1: p(cheap) = 1 / (1 + e^-2) ≈ 0.881
    assert 0.85 < cheap_share < 0.91
    assert picks[0][2] == pytest.approx(0.881, abs=0.001) or picks[0][2] == pytest.approx(0.119, abs=0.001)
    assert "sampled at temperature 0.5" in picks[0][1]


def test_validation() -> None:
    with pytest.raises(ValueError, match="temperature"):
        CostConfig(temperature=-1)
    with pytest.raises(ValueError, match="tier_weights"):
        CostConfig(tier_weights={"device": 1.0})
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        CostConfig(tier_weights={"device": 1.5, "host": 0.75, "disk": 0.25, "shared": 0.5})
    with pytest.raises(ValueError, match="no candidate"):
        choose([], 0.0, random.Random(0))
    assert CostConfig().tier_preference() == ("device", "host", "shared", "disk")
