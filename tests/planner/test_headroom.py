"""Headroom from the forecaster's own errors: the margin is the chosen quantile of the recent
actual − forecast request counts (numpy's quantile as the reference), none without a quantile or
before enough errors, and the planner sizes for forecast + margin and says so."""
from __future__ import annotations

import numpy as np
import pytest

from tests.planner.test_constrain import FixedModel, Steady, _obs
from tokenmill.planner.constrain import Constrainer, Limits
from tokenmill.planner.headroom import MIN_ERRORS, ForecastErrors
from tokenmill.planner.planner import Planner
from tokenmill.planner.propose import Proposer


def test_the_margin_is_the_quantile_of_recent_errors() -> None:
    errors = ForecastErrors(0.9, window=8)
    forecasts = [100, 120, 90, 300, 100, 100, 80, 500, 100, 100]
    actuals = [110, 100, 250, 120, 90, 400, 85, 100, 130, 60]
    seen = []
    for forecast, actual in zip(forecasts, actuals):
        errors.expect(forecast)
        errors.record(actual)
        seen.append(actual - forecast)
        expected = max(np.quantile(seen[-8:], 0.9), 0.0) if len(seen) >= MIN_ERRORS else 0.0
        assert errors.margin() == pytest.approx(expected)
    assert errors.margin() > 0


def test_no_quantile_means_the_point_forecast_and_a_bad_one_is_refused() -> None:
    errors = ForecastErrors(None)
    for _ in range(10):
        errors.expect(0.0)
        errors.record(1000.0)
    assert errors.margin() == 0.0
    for bad in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="--forecast-quantile"):
            ForecastErrors(bad)


def test_the_planner_sizes_for_forecast_plus_margin_after_a_volatile_load() -> None:
    def planner(quantile: float | None) -> Planner:
        proposer = Proposer({"agg": FixedModel()}, disaggregated=False)  # type: ignore[dict-item]
        return Planner(Steady(), proposer, Constrainer(Limits(max_step=100), {"agg": 4}),
                       forecast_quantile=quantile)

    point, hedged = planner(None), planner(0.9)
    load = [60, 600, 60, 600, 60, 600, 60, 600]  # a last-value forecast is wrong by 540 every time
    for i, requests in enumerate(load):
        last_point = point.step(_obs(30 * (i + 1), requests, serving=5))
        last_hedged = hedged.step(_obs(30 * (i + 1), requests, serving=5))
    # the last interval had 600: the point forecast sizes for 600, the hedged one for 600 + 540
    assert last_point.forecast["error_margin"] == 0.0
    assert last_hedged.forecast["error_margin"] == pytest.approx(540.0)
    assert last_hedged.target["agg"] > last_point.target["agg"]
    assert any("forecast's recent errors" in r for r in last_hedged.proposal_reasons)
