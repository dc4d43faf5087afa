"""Load predictors: the planner's forecast of the next interval's requests, mean ISL and OSL.

Every interval the planner feeds each series one value (`observe`) and asks for the next
(`predict`). Four kinds, made by name through `make_predictor`:

- `constant`: the last value (persistence; the baseline every other kind must beat),
- `moving_average`: the mean of the last `window` values,
- `arima`: statsmodels' `ARIMA(order)` on the last `window` values,
- `kalman`: a local-linear-trend state-space model (statsmodels' `UnobservedComponents`).

The two statsmodels kinds share `_StateSpacePredictor`: parameters are re-estimated every
`refit_every` observations on a bounded window, and in between the fitted results are
`extend`ed by the new observation (one Kalman-filter step with the same parameters, no
optimisation). They fall back to the last value while the window holds fewer than
`min_points` values, when the window is constant (the likelihood is degenerate), or when no
fit has succeeded yet; a refit that raises or does not converge keeps the previous
parameters, and the next try backs off (2, 4, ... 32 observations later: a failing fit is the
costliest one). A forecast is never NaN nor negative: request counts and token means are >= 0.

statsmodels (about 1 s to import) is imported inside the predictors, so importing this
module, `tokenmill --help` and the frontend stay fast.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import warnings
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# a forecast above this multiple of the window's largest value is an exploding fit, not a
# forecast: one interval of real load never grows that fast
_MAX_GROWTH = 10.0
_MAX_BACKOFF = 32  # observations between refit attempts, at most, after repeated failures


def check_value(value: float, what: str = "value") -> float:
    """`value` as a float; ValueError (naming `what`) unless it is finite and >= 0."""
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return number


def _positive_int(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value


class Predictor(ABC):
    """One series' one-step-ahead forecaster."""

    name: str = ""

    @abstractmethod
    def observe(self, value: float) -> None:
        """The true value of the interval that just ended (ValueError unless finite, >= 0)."""

    @abstractmethod
    def predict(self) -> float:
        """The next interval's value: 0.0 before any observation."""

    def warm_start(self, values: Sequence[float]) -> None:
        """Feed a history (oldest first), as if each value had been observed in turn."""
        for value in values:
            self.observe(value)


class ConstantPredictor(Predictor):
    name = "constant"

    def __init__(self) -> None:
        self._last = 0.0

    def observe(self, value: float) -> None:
        self._last = check_value(value)

    def predict(self) -> float:
        return self._last


class MovingAveragePredictor(Predictor):
    name = "moving_average"

    def __init__(self, window: int = 4) -> None:
        self._values: deque[float] = deque(maxlen=_positive_int(window, "moving_average window"))

    def observe(self, value: float) -> None:
        self._values.append(check_value(value))

    def predict(self) -> float:
        return sum(self._values) / len(self._values) if self._values else 0.0


class _StateSpacePredictor(Predictor):
    """A statsmodels state-space model refitted on a bounded window (see the module docstring)."""

    def __init__(self, window: int, refit_every: int, min_points: int) -> None:
        self._history: deque[float] = deque(maxlen=_positive_int(window, f"{self.name} window"))
        self._refit_every = _positive_int(refit_every, f"{self.name} refit_every")
        self._min_points = max(3, _positive_int(min_points, f"{self.name} min_points"))
        self._results: Any = None  # statsmodels MLEResults of the latest good fit (or its extension)
        self._scale = 1.0          # the model sees values / scale: the optimiser is better conditioned
        self._wait = 0             # observations until the next refit is tried
        self._failures = 0         # consecutive failed refits (they back off)
        self._forecast = 0.0
        self.fits = 0              # successful parameter estimations
        self.failed_fits = 0       # refits that raised or did not converge
        self.fallbacks = 0         # forecasts that were the last value instead of the model's

    @abstractmethod
    def _model(self, endog: Any) -> Any:
        """An unfitted statsmodels MLEModel on `endog` (already divided by the scale)."""

    @abstractmethod
    def _fit(self, model: Any, start_params: Any) -> Any:
        """`model` fitted (statsmodels results), starting from `start_params` when given."""

    def observe(self, value: float) -> None:
        number = check_value(value)
        self._history.append(number)
        self._wait -= 1
        with _one_blas_thread():
            if not (self._wait <= 0 and self._refit()) and self._results is not None:
                self._extend(number)  # not due, or the refit failed: filter with the last parameters
            self._forecast = self._next()

    def warm_start(self, values: Sequence[float]) -> None:
        # one fit on the whole history, not one per value: a trace's warm-up stays cheap
        self._history.extend([check_value(value) for value in values])
        with _one_blas_thread():
            if not self._refit():
                self._results = None  # a fit from before the history would not have seen it
            self._forecast = self._next()

    def predict(self) -> float:
        return self._forecast

    def _refit(self) -> bool:
        """Estimate the parameters on the window (which holds the newest value); True on success."""
        window = list(self._history)
        if len(window) < self._min_points or max(window) == min(window):
            self._results = None  # too few points, or a constant window: nothing to estimate
            return False
        import numpy as np

        scale = float(np.std(window))
        model = self._model(np.asarray(window) / scale)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                results = self._fit(model, self._start_params(scale))
            except (ValueError, np.linalg.LinAlgError, OverflowError) as exc:
                return self._refit_failed(f"raised {exc}")
        trouble = [str(w.message) for w in caught if _is_trouble(w.category)]
        if trouble:
            return self._refit_failed(trouble[0])
        self._results, self._scale, self._wait, self._failures = results, scale, self._refit_every, 0
        self.fits += 1
        return True

    def _refit_failed(self, why: str) -> bool:
        # keep the previous parameters (observe extends them by the new value); until a first
        # fit succeeds the forecast is the last value. Back off: a fit that fails tends to fail
        # again on nearly the same window, and a failing fit is the costliest (it runs to maxiter)
        self.failed_fits += 1
        self._failures += 1
        self._wait = min(self._refit_every * 2 ** self._failures, _MAX_BACKOFF)
        log.debug("%s refit on %d points failed (%s)", self.name, len(self._history), why)
        return False

    def _start_params(self, scale: float) -> Any:
        """The previous fit's parameters, variances rescaled to the new scale."""
        if self._results is None:
            return None
        ratio = (self._scale / scale) ** 2
        names = self._results.model.param_names
        return [p * ratio if n.startswith("sigma2") else p for n, p in zip(names, self._results.params)]

    def _extend(self, value: float) -> None:
        import numpy as np

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                self._results = self._results.extend(np.array([value / self._scale]))
            except (ValueError, np.linalg.LinAlgError) as exc:
                log.debug("%s extend failed (%s): refitting next observation", self.name, exc)
                self._results, self._wait = None, 0

    def _next(self) -> float:
        last = self._history[-1] if self._history else 0.0
        if self._results is None:
            self.fallbacks += bool(self._history)
            return last
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            forecast = float(self._results.forecast(1)[0]) * self._scale
        if not math.isfinite(forecast) or forecast > _MAX_GROWTH * max(self._history):
            self.fallbacks += 1
            return last
        return max(forecast, 0.0)


def _one_blas_thread() -> Any:
    """A context that keeps BLAS on one thread, when threadpoolctl is installed.

    The Kalman filter multiplies 3x3 matrices: BLAS threads only hand them around, and on a
    busy host (two cores shared with other processes) a fit measured 5-25x slower with
    OpenBLAS's default threads than with one. Scoped, so the host's other numpy work keeps its
    threads."""
    controller = _blas_controller()
    return controller.limit(limits=1, user_api="blas") if controller is not None else contextlib.nullcontext()


@functools.cache
def _blas_controller() -> Any:
    """threadpoolctl's controller, made once (None without threadpoolctl)."""
    try:
        import scipy.linalg  # noqa: F401  (loads scipy's BLAS: the controller sees loaded ones only)
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return ThreadpoolController()


def _is_trouble(category: type[Warning]) -> bool:
    """A warning that makes a fit untrustworthy (not the benign 'starting parameters' notes)."""
    from statsmodels.tools.sm_exceptions import ConvergenceWarning

    return issubclass(category, (ConvergenceWarning, RuntimeWarning))


class ArimaPredictor(_StateSpacePredictor):
    name = "arima"

    def __init__(self, order: Sequence[int] = (1, 1, 1), window: int = 200, refit_every: int = 1,
                 min_points: int = 10) -> None:
        self.order = _check_order(order)
        super().__init__(window, refit_every, max(min_points, sum(self.order) + 3))

    def _model(self, endog: Any) -> Any:
        from statsmodels.tsa.arima.model import ARIMA

        return ARIMA(endog, order=self.order)

    def _fit(self, model: Any, start_params: Any) -> Any:
        # cov_type "none": the parameters' standard errors are never used, and their numerical
        # Hessian would cost more than the fit itself
        return model.fit(start_params=start_params, cov_type="none")


class KalmanPredictor(_StateSpacePredictor):
    name = "kalman"

    def __init__(self, window: int = 200, refit_every: int = 10, min_points: int = 10) -> None:
        super().__init__(window, refit_every, min_points)

    def _model(self, endog: Any) -> Any:
        from statsmodels.tsa.statespace.structural import UnobservedComponents

        return UnobservedComponents(endog, level="local linear trend")

    def _fit(self, model: Any, start_params: Any) -> Any:
        return model.fit(start_params=start_params, cov_type="none", disp=False)


def _check_order(order: Sequence[int]) -> tuple[int, int, int]:
    values = tuple(order)
    if len(values) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"arima order must be three integers >= 0 (p, d, q), got {order!r}")
    return values  # type: ignore[return-value]


PREDICTORS: dict[str, type[Predictor]] = {
    cls.name: cls for cls in (ConstantPredictor, MovingAveragePredictor, ArimaPredictor, KalmanPredictor)
}


def make_predictor(name: str, **options: Any) -> Predictor:
    """A predictor by name; `options` are its constructor's keywords (e.g. window=8)."""
    cls = PREDICTORS.get(name)
    if cls is None:
        raise ValueError(f"unknown predictor {name!r}: choose one of {', '.join(PREDICTORS)}")
    accepted = [p for p in inspect.signature(cls).parameters if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        takes = ", ".join(accepted) or "no options"
        raise ValueError(f"predictor {name!r} has no option {', '.join(unknown)} (it takes: {takes})")
    return cls(**options)


@dataclass(slots=True)
class LoadForecast:
    requests: float   # requests arriving in the next interval
    isl: float        # their mean input tokens
    osl: float        # their mean output tokens
    predictor: str    # the predictor kind that made it
    peak_prompt_tokens_per_s: float | None = None  # the busiest second ahead, where it is known (the oracle)


class LoadPredictor:
    """One predictor kind for each of the three series the planner sizes the fleet from."""

    def __init__(self, name: str = "arima", **options: Any) -> None:
        self.name = name
        self.requests = make_predictor(name, **options)
        self.isl = make_predictor(name, **options)
        self.osl = make_predictor(name, **options)

    def observe(self, requests: float, isl: float | None, osl: float | None) -> None:
        """One interval's truth. `isl`/`osl` None: no request arrived, so their means are unknown
        and those two predictors learn nothing (a 0 would read as a collapse of prompt length)."""
        count = check_value(requests, "requests")
        means = [(self.isl, check_value(isl, "isl") if isl is not None else None),
                 (self.osl, check_value(osl, "osl") if osl is not None else None)]
        self.requests.observe(count)
        for predictor, value in means:
            if value is not None:
                predictor.observe(value)

    def warm_start(self, requests: Sequence[float], isl: Sequence[float | None],
                   osl: Sequence[float | None]) -> None:
        """Histories, oldest first; None entries of `isl`/`osl` (empty intervals) are skipped."""
        self.requests.warm_start(requests)
        self.isl.warm_start([v for v in isl if v is not None])
        self.osl.warm_start([v for v in osl if v is not None])

    def predict(self) -> LoadForecast:
        return LoadForecast(self.requests.predict(), self.isl.predict(), self.osl.predict(), self.name)
