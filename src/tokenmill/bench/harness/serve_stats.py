"""Statistics of a `tokenmill bench serve` run, from the client's per-request records.

Definitions (every figure covers the requests with status "ok" unless it says otherwise):
- TTFT: send → first token event. E2E: send → end of stream.
- ITL: the gaps between consecutive token events of one stream, pooled over all streams.
- TPOT: a request's mean time per output token after the first,
  (e2e − ttft) / (completion_tokens − 1); exact even when a chunk carries several tokens.
- Goodput: requests per second meeting both SLOs: TTFT ≤ --slo-ttft-ms and TPOT (the
  request's mean ITL) ≤ --slo-itl-ms; an SLO left unset always holds.
- Throughputs divide by the run's duration: the first send to the last stream's end.
- Cached fraction: Σ usage.prompt_tokens_details.cached_tokens ÷ Σ usage.prompt_tokens.
- Cost: --usd-per-hour × duration / output tokens, per million output tokens.
- Stack overhead per token (only with --mock-step-ms S, against a server whose mock runner
  takes a fixed S per step, `--mock-step-time S,0,0,0`): each request's TPOT − S. The
  scheduler gives every running decode one token per step, so an ideal stack delivers a
  token every S; the excess is what the stack adds per token: the engine loop's
  bookkeeping, the worker → frontend hop, detokenization, HTTP/SSE and the client's parse.
  Per-request TPOT rather than single ITL gaps, because tokens of one stream often arrive
  in bursts (several SSE frames per read), which makes single gaps ~0 or ~2·S. With
  --mock-reference the baseline subtracted is instead the in-process mock engine's wall
  time per step on the same workload (S plus the engine loop's own bookkeeping), so the
  excess is the serving layer's own: worker process hop, frontend, HTTP/SSE, client.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenmill.bench.harness.loadgen import OK, RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class Distribution:
    """Milliseconds."""
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def distribution_ms(values_s: Sequence[float]) -> Distribution | None:
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
    return Distribution(len(ms), float(ms.mean()), p50, p90, p99, float(ms.max()))


@dataclass(slots=True, frozen=True)
class SLO:
    ttft_ms: float | None = None
    itl_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--slo-{name.replace('_', '-')} must be positive, got {value}")

    def met(self, record: RequestRecord) -> bool:
        ttft_ok = self.ttft_ms is None or (record.ttft_s is not None and record.ttft_s * 1e3 <= self.ttft_ms)
        tpot = tpot_s(record)
        itl_ok = self.itl_ms is None or tpot is None or tpot * 1e3 <= self.itl_ms
        return ttft_ok and itl_ok


def tpot_s(record: RequestRecord) -> float | None:
    """Mean seconds per output token after the first; None for a one-token answer."""
    if record.e2e_s is None or record.ttft_s is None or not record.completion_tokens:
        return None
    if record.completion_tokens < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)


@dataclass(slots=True)
class ServeSummary:
    duration_s: float
    requests_total: int
    requests_ok: int
    outcomes: dict[str, int]        # status → count, every status seen
    length_mismatches: int          # ok requests whose usage differs from what was asked
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    cached_fraction: float
    request_throughput: float       # ok requests / s
    output_token_throughput: float  # tokens / s
    input_token_throughput: float
    goodput: float                  # ok requests meeting the SLOs / s
    slo_met: int
    usd_per_million_output_tokens: float | None
    ttft_ms: Distribution | None
    itl_ms: Distribution | None
    tpot_ms: Distribution | None
    e2e_ms: Distribution | None
    overhead_per_token_ms: Distribution | None
    overhead_baseline_ms: float | None  # the per-token time subtracted: S, or the reference's wall step


def run_duration_s(records: Sequence[RequestRecord]) -> float:
    started = [r for r in records if r.start_s is not None]
    if not started:
        return 0.0
    ends = [r.start_s + (r.e2e_s or 0.0) for r in started]
    return max(ends) - min(r.start_s for r in started)


def summarize(records: Sequence[RequestRecord], slo: SLO, usd_per_hour: float | None,
              baseline_step_ms: float | None = None, duration_s: float | None = None) -> ServeSummary:
    ok = [r for r in records if r.status == OK]
    duration = duration_s if duration_s is not None else run_duration_s(records)
    per_s = 1.0 / duration if duration > 0 else 0.0
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    output = sum(r.completion_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    gaps = [gap for r in ok for gap in r.itl_s]
    met = sum(1 for r in ok if slo.met(r))
    cost = None
    if usd_per_hour is not None and output:
        cost = usd_per_hour * duration / 3600.0 / output * 1e6
    overhead = None
    if baseline_step_ms is not None:
        overhead = distribution_ms([t - baseline_step_ms / 1e3 for r in ok if (t := tpot_s(r)) is not None])
    mismatches = sum(1 for r in ok if r.completion_tokens != r.output_len or r.prompt_tokens != r.prompt_len)
    return ServeSummary(
        duration_s=duration, requests_total=len(records), requests_ok=len(ok),
        outcomes=dict(Counter(r.status for r in records)), length_mismatches=mismatches,
        prompt_tokens=prompt, output_tokens=output, cached_tokens=cached,
        cached_fraction=cached / prompt if prompt else 0.0, request_throughput=len(ok) * per_s,
        output_token_throughput=output * per_s, input_token_throughput=prompt * per_s,
        goodput=met * per_s, slo_met=met, usd_per_million_output_tokens=cost,
        ttft_ms=distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_ms=distribution_ms(gaps),
        tpot_ms=distribution_ms([t for r in ok if (t := tpot_s(r)) is not None]),
        e2e_ms=distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        overhead_per_token_ms=overhead, overhead_baseline_ms=baseline_step_ms,
    )
