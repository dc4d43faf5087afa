"""The burst forecast: the conformal order statistic of the recent intervals' busiest seconds,
which covers the next one at its nominal rate on a synthetic on/off load of gamma bursts; the
load shape sizing for it; and the planner's lookahead carrying the forecast's own rise, not its
distance from a quiet interval's count."""
from __future__ import annotations

import numpy as np
import pytest

from tests.planner.test_constrain import FixedModel, Steady, _obs
from tests.planner.test_propose import Load
from tokenmill.planner.bursts import BurstForecast
from tokenmill.planner.constrain import Constrainer, Limits
from tokenmill.planner.load_shape import LoadShape
from tokenmill.planner.observation import Observation
from tokenmill.planner.planner import Planner
from tokenmill.planner.propose import Proposer

INTERVAL_S = 30
PERIOD_S = 75  # a burst starts every 75 s: not a multiple of the interval, so intervals hold 0, 1 or 2
BURST_S = 10


def on_off_peaks(seconds: int, seed: int) -> list[float]:
    """Each interval's busiest second of prompt tokens: bursts of BURST_S seconds every PERIOD_S,
    each at a gamma-distributed rate (shape 2: some bursts several times the typical one), Poisson
    arrivals within it, log-normal prompt lengths; nothing between bursts."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros(seconds)
    for start in range(0, seconds, PERIOD_S):
        rate = rng.gamma(2.0, 10.0)  # requests per second during this burst
        for second in range(start, min(start + BURST_S, seconds)):
            tokens[second] = rng.lognormal(7.0, 0.8, rng.poisson(rate)).sum()
    return [float(tokens[i:i + INTERVAL_S].max()) for i in range(0, seconds, INTERVAL_S)]


# the levels a planner sizes for; at 0.5 the quiet intervals (ties at 0, ~45% of them here) make it
# cover 60%: a conformal bound may cover more than asked, never less
@pytest.mark.parametrize("quantile", [0.7, 0.8, 0.9, 0.95])
def test_the_forecast_covers_the_next_peak_at_its_nominal_rate(quantile: float) -> None:
    warmup = 40
    covered = total = 0
    for seed in range(4):
        bursts = BurstForecast(window=40)
        for i, peak in enumerate(on_off_peaks(4000 * INTERVAL_S // 4, seed)):
            if i >= warmup:
                covered += peak <= bursts.quantile(quantile)
                total += 1
            bursts.observe(peak)
    assert abs(covered / total - quantile) <= 0.05, covered / total


def test_the_forecast_is_the_conformal_order_statistic() -> None:
    bursts = BurstForecast(window=5)
    assert bursts.quantile(0.9) == 0.0  # nothing seen yet
    for peak in (50.0, 10.0, 40.0, 20.0, 30.0, 60.0):  # the first leaves the window
        bursts.observe(peak)
    # n = 5: q = 0.5 is the ⌈3⌉rd smallest; q = 0.6 the ⌈3.6⌉ = 4th; q = 0.9 would be the 6th: the largest
    assert (bursts.quantile(0.5), bursts.quantile(0.6), bursts.quantile(0.9)) == (30.0, 40.0, 60.0)
    assert bursts.quantile(None) == 60.0
    bursts.observe(-5.0)  # never below zero
    assert min(bursts.draws) == 0.0
    for bad in (0.0, 1.0, 1.2):
        with pytest.raises(ValueError, match="--burst-quantile"):
            bursts.quantile(bad)


def test_the_load_shape_sizes_for_the_burst_quantile_over_its_burst_window() -> None:
    def shape_after(quantile: float | None) -> LoadShape:
        shape = LoadShape(window=4, burst_quantile=quantile, burst_window=20)
        for i in range(20):  # one burst of 100k in twenty intervals of 5k
            peak = 100_000.0 if i == 3 else 5_000.0
            shape.update(Observation(at_s=30.0 * i, interval_s=30.0, requests=100, peak_prompt_tokens_per_s=peak))
        return shape

    assert shape_after(None).peak_tokens_per_s() == 5_000.0  # the burst left the last 4
    assert shape_after(0.9).peak_tokens_per_s() == 5_000.0  # one in twenty is above the 90% quantile
    assert shape_after(0.97).peak_tokens_per_s() == 100_000.0
    with pytest.raises(ValueError, match="--burst-quantile"):
        LoadShape(burst_quantile=1.0)


class MeanOfTwo(Steady):
    """The mean of the last two counts: on an on/off load it sits between them, not rising."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = [0.0, 0.0]

    def observe(self, requests: float, isl: float | None, osl: float | None) -> None:
        super().observe(requests, isl, osl)
        self.counts = [self.counts[1], requests]

    def predict(self) -> Load:
        return Load(sum(self.counts) / 2, self.last.isl, self.last.osl)


class Trend(MeanOfTwo):
    """The last count plus its last change: a ramp's next value."""

    def predict(self) -> Load:
        return Load(max(2 * self.counts[1] - self.counts[0], 0.0), self.last.isl, self.last.osl)


def _horizons(forecaster: Steady, counts: list[int]) -> list[float]:
    planner = Planner(forecaster, Proposer({"agg": FixedModel()}, disaggregated=False),  # type: ignore[dict-item]
                      Constrainer(Limits(max_step=100), {"agg": 4}), lookahead_intervals=2.0)
    return [planner.step(_obs(30.0 * (i + 1), n, serving=5)).forecast["requests_at_horizon"]
            for i, n in enumerate(counts)]


def test_the_lookahead_carries_a_rise_not_a_quiet_intervals_gap() -> None:
    # the forecast holds at 300 from the second interval on: nothing to carry, however far below it
    # a quiet interval's count is
    assert _horizons(MeanOfTwo(), [600, 0, 600, 0, 600, 0])[2:] == [300.0] * 4
    # a ramp of +100 per interval: forecast 500 after 400, carried two intervals on
    assert _horizons(Trend(), [100, 200, 300, 400])[-1] == pytest.approx(500.0 + 2 * 100.0)
    # a persistence forecast never carries anything: its forecast is the count itself
    assert _horizons(Steady(), [100, 300, 200, 600]) == [100.0, 300.0, 200.0, 600.0]
