"""Headroom from the forecaster's own recent errors: size for an upper quantile of the load, not
its point forecast.

Each interval the request count that arrived is set against the forecast made for it one
interval earlier; `margin()` is the `quantile` of the recent errors (actual − forecast, in
requests), which the planner adds to a new forecast. A steady load the predictor follows well gets almost nothing; a
volatile one (the Azure code trace's 30 s counts jump 0 → 500) gets headroom in proportion to how
wrong the forecasts have been, which a 60 s replica start-up cannot otherwise make up. Errors are
additive, not ratios, so a forecast near zero does not blow up. With no quantile (the default)
or too few errors yet, the point forecast stands.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from tokenmill.planner.flags import check_quantile

MIN_ERRORS = 5  # a quantile of fewer errors than this says little


class ForecastErrors:
    def __init__(self, quantile: float | None, window: int = 20) -> None:
        check_quantile(quantile, "--forecast-quantile")
        self.quantile = quantile
        self.errors: deque[float] = deque(maxlen=window)
        self._pending: float | None = None  # the forecast made for the coming interval

    def record(self, actual: float) -> None:
        """This interval's arrivals, against what was forecast for it."""
        if self._pending is not None:
            self.errors.append(actual - self._pending)
        self._pending = None

    def expect(self, forecast: float) -> None:
        self._pending = forecast

    def margin(self) -> float:
        """Requests to add to a point forecast (never negative)."""
        if self.quantile is None or len(self.errors) < MIN_ERRORS:
            return 0.0
        return max(float(np.quantile(np.asarray(self.errors), self.quantile)), 0.0)
