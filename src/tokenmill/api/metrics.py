"""Prometheus metrics for one app, in the app's own registry (tests build many apps).

The frontend measures what it sees per request (TTFT, ITL, end-to-end latency, token
counts, outcomes). Worker-side and router series come from `Backend.metrics_snapshot()`,
read at scrape time and typed by their names (`metric_families.py`); its keys are Prometheus
series names, optionally with labels:
`tokenmill_worker_kv_usage{worker="w0"}`. `tokenmill_workers` (the number of serving
workers) also feeds the cost gauge `tokenmill_cost_per_million_tokens`:
    usd_per_worker_hour × workers ÷ (output tokens per hour over the last window) × 1e6.
"""
from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.api.metric_families import typed_families
from tokenmill.api.tenancy import RequestScope, current_request

log = logging.getLogger(__name__)

PREFIX = "tokenmill_"
WORKERS_GAUGE = "tokenmill_workers"
_SERIES = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 120.0)
_TOKENS_PER_SECOND_BUCKETS = tuple(round(64 * 2 ** (k / 2)) for k in range(38))  # 64 .. ~12M, x1.41 apart
_STREAM_BUCKETS = (0.0, *sorted({round(2 ** (k / 4)) for k in range(57)}))  # 0, 1 .. 16384, ~x1.19 apart
RATE_WINDOW_S = 60.0


def parse_series(key: str) -> tuple[str, dict[str, str]] | None:
    """'name{a="x",b="y"}' -> ('name', {'a': 'x', 'b': 'y'}); None when malformed."""
    match = _SERIES.match(key.strip())
    if match is None:
        return None
    name, label_text = match.group(1), match.group(2) or ""
    labels = {m.group(1): m.group(2) for m in _LABEL.finditer(label_text)}
    if _LABEL.sub("", label_text).strip():
        return None
    return (name if name.startswith(PREFIX) else PREFIX + name), labels


class OutputTokenRate:
    """Output tokens per second over the last `window_s`, from one-second buckets."""

    def __init__(self, window_s: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._buckets: deque[list[float]] = deque()  # [second, tokens]
        self._first_seen: float | None = None

    def add(self, tokens: int) -> None:
        now = self.clock()
        if self._first_seen is None:
            self._first_seen = now
        second = float(int(now))
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += tokens
        else:
            self._buckets.append([second, float(tokens)])

    def per_second(self) -> float:
        now = self.clock()
        while self._buckets and self._buckets[0][0] < now - self.window_s:
            self._buckets.popleft()
        if self._first_seen is None:
            return 0.0
        span = min(self.window_s, max(now - self._first_seen, 1.0))
        return sum(tokens for _, tokens in self._buckets) / span


class _BackendCollector(Collector):
    """Backend series (typed: `metric_families.py`) plus the derived cost gauge, at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, float]], rate: OutputTokenRate,
                 usd_per_worker_hour: float | None) -> None:
        self.snapshot = snapshot
        self.rate = rate
        self.usd_per_worker_hour = usd_per_worker_hour
        self._warned: set[str] = set()  # malformed keys, logged once rather than at every scrape

    def collect(self) -> Iterator[Metric]:
        try:
            snapshot = self.snapshot()
        except Exception:  # a broken snapshot must not take the other metrics down
            log.exception("backend metrics_snapshot failed")
            snapshot = {}
        yield from self._families(snapshot)
        if self.usd_per_worker_hour is not None:
            yield GaugeMetricFamily("tokenmill_usd_per_worker_hour", "the price of a worker-hour the cost is "
                                    "reckoned at", value=self.usd_per_worker_hour)
        cost = self._cost(snapshot.get(WORKERS_GAUGE, 1.0))
        if cost is not None:
            yield GaugeMetricFamily("tokenmill_cost_per_million_tokens",
                                    "USD per million output tokens: workers x the price of a worker-hour, "
                                    "over the output rate of the last minute", value=cost)

    def _families(self, snapshot: dict[str, float]) -> Iterator[Metric]:
        series = []
        for key, value in sorted(snapshot.items()):
            parsed = parse_series(key)
            if parsed is None:
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning("ignoring malformed backend metric %r", key)
                continue
            series.append((*parsed, float(value)))
        return typed_families(series)

    def _cost(self, workers: float) -> float | None:
        tokens_per_s = self.rate.per_second()
        if self.usd_per_worker_hour is None or tokens_per_s <= 0:
            return None
        return self.usd_per_worker_hour * workers / (tokens_per_s * 3600.0) * 1e6


class PromptTokensPerSecond:
    """Prompt tokens admitted in each whole second of the monotonic clock, observed into a
    histogram once that second is over (at the next admission): its upper quantiles are the
    busiest seconds, the bursts a prefill pool must clear within the TTFT target."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self.second: int | None = None
        self.tokens = 0

    def add(self, now: float, tokens: int) -> None:
        second = int(now)
        if second != self.second:
            if self.second is not None:
                self.histogram.observe(self.tokens)
            self.second, self.tokens = second, 0
        self.tokens += tokens


class DecodeStreams:
    """Streams past their first token and not finished, sampled at every whole second of the
    monotonic clock into a histogram. Samples are taken at the next start or end: the count
    held since is the count at each second passed (at most MAX_HELD_S of them). The histogram's
    mean (`_sum / _count`) and upper quantiles over an interval are how far a decode pool's
    batches peak above their mean: the planner's decode headroom."""
    MAX_HELD_S = 3600

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self.count = 0
        self.second: int | None = None

    def started(self, now: float) -> None:
        self._sample_until(now)
        self.count += 1

    def ended(self, now: float) -> None:
        self._sample_until(now)
        self.count -= 1

    def _sample_until(self, now: float) -> None:
        second = int(now)
        if self.second is not None:
            for _ in range(min(second - self.second, self.MAX_HELD_S)):
                self.histogram.observe(self.count)
        self.second = second


class FrontendMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, float]], usd_per_worker_hour: float | None = None) -> None:
        self.registry = CollectorRegistry()
        self.output_rate = OutputTokenRate()
        r = self.registry
        self.ttft = Histogram("tokenmill_time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tokenmill_inter_token_latency_seconds", "time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tokenmill_e2e_request_latency_seconds", "request arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.input_tokens = Counter("tokenmill_input_tokens", "prompt tokens", registry=r)
        self.output_tokens = Counter("tokenmill_output_tokens", "generated tokens", registry=r)
        self.generated_tokens = Counter("tokenmill_generated_tokens", "output tokens as they reach the clients "
                                        "(tokenmill_output_tokens_total counts them as requests finish)", registry=r)
        self.cached_tokens = Counter("tokenmill_cached_tokens", "prompt tokens served from a prefix cache",
                                     registry=r)
        self.requests = Counter("tokenmill_requests", "finished requests by outcome", ["status"], registry=r)
        # demand where it is admitted: under backpressure completions lag and would hide it (the planner reads this)
        self.requests_started = Counter("tokenmill_requests_started", "generation requests admitted", registry=r)
        # how spread the prompt lengths are and how bursty their arrival: the planner's prefill headroom
        self.input_tokens_squared = Counter("tokenmill_input_tokens_squared", "sum of squared prompt lengths",
                                            registry=r)
        self.prompt_tokens_per_second = PromptTokensPerSecond(Histogram(
            "tokenmill_prompt_tokens_per_second", "prompt tokens admitted in each second that admitted any",
            buckets=_TOKENS_PER_SECOND_BUCKETS, registry=r))
        self.decode_streams = DecodeStreams(Histogram(
            "tokenmill_decode_streams", "streams past their first token, sampled each second",
            buckets=_STREAM_BUCKETS, registry=r))
        r.register(_BackendCollector(snapshot, self.output_rate, usd_per_worker_hour))

    def count_request(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def count_http_error(self, status: int) -> None:
        labels = {429: "overloaded", 503: "unavailable"}
        self.count_request(labels.get(status, "error" if status >= 500 else "rejected"))

    def start_request(self, prompt_tokens: int = 0) -> RequestTimer:
        now = time.monotonic()
        self.requests_started.inc()
        self.prompt_tokens_per_second.add(now, prompt_tokens)
        return RequestTimer(self, now, current_request.get())


@dataclass(slots=True)
class RequestTimer:
    """One stream's latency bookkeeping: TTFT at the first token, ITL per token after it; its
    outcome and tokens are charged to its request's tenant and fleet slot too, where it has them."""
    metrics: FrontendMetrics
    arrival: float
    scope: RequestScope | None = None
    last_token_at: float | None = None
    ttft_s: float | None = None
    step_seconds: float = 0.0  # the engine's step time its tokens caused, as its outputs reported it

    def on_tokens(self, count: int, step_seconds: float = 0.0) -> None:
        self.step_seconds += step_seconds
        if count <= 0:
            return
        now = time.monotonic()
        if self.last_token_at is None:
            self.ttft_s = now - self.arrival
            self.metrics.ttft.observe(self.ttft_s)
            self.metrics.decode_streams.started(now)
        else:
            per_token = (now - self.last_token_at) / count  # a delta may carry several tokens
            for _ in range(count):
                self.metrics.itl.observe(per_token)
        self.last_token_at = now
        self.metrics.output_rate.add(count)
        self.metrics.generated_tokens.inc(count)

    def on_finish(self, status: str, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> None:
        m = self.metrics
        now = time.monotonic()
        m.e2e.observe(now - self.arrival)
        if self.last_token_at is not None:
            m.decode_streams.ended(now)
        m.count_request(status)
        m.input_tokens.inc(prompt_tokens)
        m.input_tokens_squared.inc(prompt_tokens * prompt_tokens)
        m.output_tokens.inc(output_tokens)
        m.cached_tokens.inc(cached_tokens)
        if self.scope is not None:
            self.scope.finished(status, prompt_tokens, output_tokens, cached_tokens, self.step_seconds)
