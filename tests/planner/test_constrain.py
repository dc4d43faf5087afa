"""The limits between a proposal and an action: bounds, budgets, step limit, the sustained
scale-down rule and the survivors rule (no 2 <-> 1 oscillation), zero traffic, missing metrics."""
from __future__ import annotations

import pytest

from tests.planner.test_propose import FixedModel, Load
from tokenmill.planner.constrain import Constrainer, Limits
from tokenmill.planner.observation import SERVING, STARTING, Observation
from tokenmill.planner.planner import Planner
from tokenmill.planner.propose import Proposer


def test_bounds_step_and_gpu_budget() -> None:
    c = Constrainer(Limits(min_replicas={"prefill": 1, "decode": 2}, max_replicas={"decode": 10}, max_step=3,
                           gpu_budget=40), {"prefill": 4, "decode": 4})
    out = c.apply({"prefill": 0, "decode": 20}, {"prefill": 1, "decode": 2}, {})
    assert out.replicas == {"prefill": 1, "decode": 5}  # min 1; max 10 then +3 per interval
    assert any("maximum 10" in n for n in out.notes) and any("at most 3 per interval" in n for n in out.notes)
    out = c.apply({"prefill": 6, "decode": 8}, {"prefill": 5, "decode": 7}, {})
    # 14 replicas x 4 GPUs > 40: trimmed from the pool growing most (ties: the larger) down to 10
    assert out.replicas == {"prefill": 4, "decode": 6}
    assert any("GPU budget 40" in n for n in out.notes)


def test_power_budget_counts_gpus_by_their_watts() -> None:
    c = Constrainer(Limits(power_kw=7.0), {"agg": 4}, watts_per_gpu=700.0)  # 10 GPUs -> 2 replicas of 4
    assert c.apply({"agg": 5}, {"agg": 2}, {}).replicas == {"agg": 2}


def test_scale_down_waits_for_a_sustained_proposal() -> None:
    c = Constrainer(Limits(scale_down_intervals=3), {"agg": 1})
    held = [c.apply({"agg": 2}, {"agg": 4}, {"agg": 1.5}).replicas["agg"] for _ in range(2)]
    assert held == [4, 4]
    assert c.apply({"agg": 2}, {"agg": 4}, {"agg": 1.5}).replicas["agg"] == 2
    c.apply({"agg": 5}, {"agg": 4}, {"agg": 4.5})  # a higher proposal resets the count
    assert c.apply({"agg": 2}, {"agg": 4}, {"agg": 1.5}).replicas["agg"] == 4


def test_survivors_must_absorb_the_load_so_two_and_one_do_not_alternate() -> None:
    c = Constrainer(Limits(scale_down_intervals=1, scale_down_utilisation=0.8), {"agg": 1})
    # 0.9 replicas of load rounds to 1, but one survivor would run at 90% > 80%: keep 2
    out = c.apply({"agg": 1}, {"agg": 2}, {"agg": 0.9})
    assert out.replicas == {"agg": 2} and "keeping 2" in out.notes[0]
    assert c.apply({"agg": 1}, {"agg": 2}, {"agg": 0.7}).replicas == {"agg": 1}


def test_limits_refuse_nonsense() -> None:
    for bad in (dict(max_step=0), dict(scale_down_utilisation=1.5), dict(min_replicas={"agg": 3}, max_replicas={"agg": 2}),
                dict(gpu_budget=0), dict(power_kw=-1.0), dict(scale_down_intervals=0)):
        with pytest.raises(ValueError):
            Limits(**bad)


class Steady:
    """A forecaster that says the last value again (the planner's contract, without statsmodels)."""

    def __init__(self) -> None:
        self.last = Load(0, 1, 1)

    def observe(self, requests: float, isl: float | None, osl: float | None) -> None:
        self.last = Load(requests, isl or self.last.isl, osl or self.last.osl)

    def predict(self) -> Load:
        return self.last


def _planner(**limits) -> Planner:
    proposer = Proposer({"agg": FixedModel()}, disaggregated=False)  # type: ignore[dict-item]
    return Planner(Steady(), proposer, Constrainer(Limits(**limits), {"agg": 4}))


def _obs(at: float, requests: int | None, serving: int, starting: int = 0) -> Observation:
    return Observation(at_s=at, interval_s=30.0, requests=requests, mean_isl=1000.0 if requests else None,
                       mean_osl=300.0 if requests else None, replicas={"agg": {SERVING: serving, STARTING: starting}})


def test_zero_traffic_goes_to_the_minimum_and_missing_metrics_hold() -> None:
    planner = _planner(scale_down_intervals=2, max_step=10)
    first = planner.step(_obs(30, 600, serving=5))  # 20 req/s: 2.0 + 3.0 = 5 replicas' worth
    assert first.target == {"agg": 5} and not first.actions
    assert planner.step(_obs(60, 0, serving=5)).target == {"agg": 5}  # one quiet interval: held
    quiet = planner.step(_obs(90, 0, serving=5))
    assert quiet.target == {"agg": 1} and quiet.actions[0].delta == -4
    missing = planner.step(Observation(at_s=120, interval_s=30.0, replicas={"agg": {SERVING: 1}}))
    assert missing.held and "missing" in missing.reason and not missing.actions


def test_every_decision_says_why_and_starting_replicas_count_as_present() -> None:
    planner = _planner(max_step=2)
    up = planner.step(_obs(30, 600, serving=1))
    assert [(a.role, a.delta) for a in up.actions] == [("agg", 2)]
    assert up.reason.startswith("agg: 20.00 req/s") and "at most 2 per interval" in up.reason
    assert up.reason.endswith("+2 agg")
    again = planner.step(_obs(60, 600, serving=1, starting=2))  # the two asked for are starting
    assert [(a.role, a.delta) for a in again.actions] == [("agg", 2)]
    assert again.to_json()["observed"]["replicas"] == {"agg": {SERVING: 1, STARTING: 2}}
