"""How spread and how bursty the recent load was: the headroom the planner sizes beside the mean.

Each figure is kept over the last `window` intervals that measured it, since bursts come back:
one calm interval must not drop the headroom the last burst needed.

- `variability()`: (ca² + cs²)/2 of the prefill queue, with Poisson gaps (ca² = 1) and the
  prompt lengths' cs² averaged over the window (Pollaczek-Khinchine's M/G/1); ½ until measured.
  The gaps' own ca² is not used: a prefill replica batches a burst's prompts into one chunk, so
  gaps far below a step cost nothing, and Kingman's formula on them over-provisions many times
  over (measured on the Azure code trace). Bursts are the prefill floor instead:
- `peak_tokens_per_s()`: the coming interval's busiest second of prompt tokens, forecast from the
  recent intervals' (`BurstForecast`): the highest of the last `window`, or with `burst_quantile`
  the conformal quantile of the last `burst_window`.
- `stream_peak_ratio()`: how far the streams a decode pool holds rise above their mean within
  an interval (the 90th percentile of each second's count ÷ the interval's mean), the median
  of the window, within [1, MAX_STREAM_PEAK_RATIO]; 1 until measured. The median, not the
  highest: an interval in which the load ramps up from nothing (or drains to nothing) has a
  ratio of 2-3 from its trend alone, which the forecast already follows. A decode pool sized for
  the mean number of streams runs its batches past the ITL budget whenever they peak, and a
  stream's mean ITL spans seconds, not a whole interval, so the interval's mean hides those
  peaks (measured on Azure conv: the seconds' p90 is 1.2-1.5x the mean, and the ITL misses fell
  exactly in the intervals whose peak passed the pool's budgeted batch).
"""
from __future__ import annotations

import statistics
from collections import deque

from tokenmill.planner.bursts import BurstForecast
from tokenmill.planner.flags import check_quantile
from tokenmill.planner.observation import Observation
from tokenmill.planner.perf_model import POISSON_VARIABILITY

MIN_REQUESTS_FOR_SPREAD = 8  # fewer prompts than this say little about an interval's spread
MIN_STREAMS_FOR_PEAKS = 8.0  # a mean below this many streams says little about their peaks
MAX_STREAM_PEAK_RATIO = 3.0


class LoadShape:
    def __init__(self, window: int = 10, burst_quantile: float | None = None, burst_window: int = 40) -> None:
        check_quantile(burst_quantile, "--burst-quantile")
        self.spreads: deque[float] = deque(maxlen=window)
        self.burst_quantile = burst_quantile
        self.bursts = BurstForecast(window if burst_quantile is None else burst_window)
        self.stream_peaks: deque[float] = deque(maxlen=window)

    def update(self, obs: Observation) -> None:
        if obs.requests == 0:
            self.bursts.observe(0.0)  # a quiet interval: zero traffic must reach the minimum in time
        elif obs.peak_prompt_tokens_per_s is not None:
            self.bursts.observe(obs.peak_prompt_tokens_per_s)
        if obs.isl_cv2 is not None and (obs.requests or 0) >= MIN_REQUESTS_FOR_SPREAD:
            self.spreads.append(obs.isl_cv2)
        mean, p90 = obs.streams_mean, obs.streams_p90
        if mean is not None and p90 is not None and mean >= MIN_STREAMS_FOR_PEAKS:
            self.stream_peaks.append(min(max(p90 / mean, 1.0), MAX_STREAM_PEAK_RATIO))

    def variability(self) -> float:
        if not self.spreads:
            return POISSON_VARIABILITY
        return (1.0 + sum(self.spreads) / len(self.spreads)) / 2

    def peak_tokens_per_s(self) -> float:
        return self.bursts.quantile(self.burst_quantile)

    def stream_peak_ratio(self) -> float:
        return float(statistics.median(self.stream_peaks)) if self.stream_peaks else 1.0
