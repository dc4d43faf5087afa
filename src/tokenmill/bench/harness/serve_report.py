"""Results of `tokenmill bench serve`: the JSON schema and the rich table.

JSON written by `--json OUT` (schema "tokenmill.bench.serve", version 1; times in seconds
unless the key ends in _ms; definitions in `tokenmill.bench.harness.serve_stats`):

    {
      "schema": "tokenmill.bench.serve", "schema_version": 1,
      "config": {url, model, mode ("concurrency" | "request_rate" | "trace"), and every flag:
                 concurrency, request_rate, trace, num_requests, seed, input/output lengths,
                 tokens_per_hash_block, time_scale, max_requests, slo_ttft_ms, slo_itl_ms,
                 usd_per_hour, timeout_s, max_duration_s, mock_step_ms, engine_workload, ...},
      "workload": {num_requests, prompt_tokens, prompt_len_min, prompt_len_mean, prompt_len_max,
                   output_tokens, output_len_min, output_len_mean, output_len_max,
                   arrival_span_s (last arrival offset; 0 for closed loop)},
      "results": {duration_s, requests_total, requests_ok,
                  outcomes {status: count}  (ok, http_429, http_4xx, http_5xx, timeout,
                                             connection_error, stream_error, cancelled, not_sent),
                  length_mismatches, prompt_tokens, output_tokens, cached_tokens, cached_fraction,
                  request_throughput, output_token_throughput, input_token_throughput (per s),
                  goodput (per s), slo_met, usd_per_million_output_tokens (null: no --usd-per-hour),
                  ttft_ms, itl_ms, tpot_ms, e2e_ms, overhead_per_token_ms:
                      null or {count, mean, p50, p90, p99, max}  (overhead: only with --mock-step-ms),
                  overhead_baseline_ms (per-token time the overhead is measured against, or null)},
      "engine_comparison": null or {engine_json (or the in-process mock reference), engine_output_tokens_per_s,
                                    serve_output_tokens_per_s, ratio (serve ÷ engine)},
      "requests": only with --save-requests: [{index, prompt_len, output_len (asked), status,
                  start_s, ttft_s, e2e_s, itl_s [gaps], http_status, error, finish_reason,
                  prompt_tokens, completion_tokens, cached_tokens (from usage)}]
    }
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.bench.harness.loadgen import RequestRecord
from tokenmill.bench.harness.serve_stats import Distribution, ServeSummary
from tokenmill.workloads.prompt_synth import RequestSpec

SCHEMA_NAME = "tokenmill.bench.serve"
SCHEMA_VERSION = 1
TOP_LEVEL_KEYS = ("schema", "schema_version", "config", "workload", "results", "engine_comparison")


@dataclass(slots=True)
class EngineComparison:
    engine_json: str
    engine_output_tokens_per_s: float
    serve_output_tokens_per_s: float
    ratio: float


def workload_summary(specs: Sequence[RequestSpec]) -> dict[str, Any]:
    plens = [len(s.prompt) for s in specs]
    olens = [s.output_len for s in specs]
    arrivals = [s.arrival_s for s in specs if s.arrival_s is not None]
    return {"num_requests": len(specs), "prompt_tokens": sum(plens), "prompt_len_min": min(plens),
            "prompt_len_mean": sum(plens) / len(plens), "prompt_len_max": max(plens),
            "output_tokens": sum(olens), "output_len_min": min(olens),
            "output_len_mean": sum(olens) / len(olens), "output_len_max": max(olens),
            "arrival_span_s": max(arrivals, default=0.0)}


def request_json(record: RequestRecord) -> dict[str, Any]:
    row = asdict(record)
    del row["token_times_s"]
    row["itl_s"] = record.itl_s
    return row


def report_json(config: dict[str, Any], specs: Sequence[RequestSpec], summary: ServeSummary,
                comparison: EngineComparison | None, records: Sequence[RequestRecord] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, "config": config,
                           "workload": workload_summary(specs), "results": asdict(summary),
                           "engine_comparison": asdict(comparison) if comparison else None}
    if records is not None:
        out["requests"] = [request_json(r) for r in records]
    return out


def _dist_row(table: Table, name: str, dist: Distribution | None) -> None:
    if dist is None:
        table.add_row(name, "-", "-", "-", "-", "-")
        return
    table.add_row(name, *(f"{v:.2f}" for v in (dist.mean, dist.p50, dist.p90, dist.p99, dist.max)))


def render_table(summary: ServeSummary, comparison: EngineComparison | None, console: Console) -> None:
    latency = Table(title="tokenmill bench serve: latency (ms)")
    for column in ("metric", "mean", "p50", "p90", "p99", "max"):
        latency.add_column(column, justify="left" if column == "metric" else "right")
    for name, dist in (("TTFT", summary.ttft_ms), ("ITL", summary.itl_ms), ("TPOT", summary.tpot_ms),
                       ("E2E", summary.e2e_ms), ("stack overhead / token", summary.overhead_per_token_ms)):
        if name != "stack overhead / token" or dist is not None:
            _dist_row(latency, name, dist)
    console.print(latency)
    totals = Table(title="throughput and outcomes")
    totals.add_column("metric")
    totals.add_column("value", justify="right")
    outcomes = ", ".join(f"{k}={v}" for k, v in sorted(summary.outcomes.items()))
    cost = summary.usd_per_million_output_tokens
    rows = [("requests ok / total", f"{summary.requests_ok} / {summary.requests_total}"), ("outcomes", outcomes),
            ("length mismatches", str(summary.length_mismatches)), ("duration s", f"{summary.duration_s:.2f}"),
            ("requests / s", f"{summary.request_throughput:.2f}"),
            ("output tokens / s", f"{summary.output_token_throughput:.1f}"),
            ("input tokens / s", f"{summary.input_token_throughput:.1f}"),
            ("goodput (requests / s within SLO)", f"{summary.goodput:.2f} ({summary.slo_met} met)"),
            ("cached-token fraction", f"{summary.cached_fraction:.3f}"),
            ("USD / M output tokens", "-" if cost is None else f"{cost:.4f}")]
    if summary.overhead_baseline_ms is not None:
        rows.append(("overhead baseline ms / token", f"{summary.overhead_baseline_ms:.3f}"))
    if comparison is not None:
        rows += [("engine output tokens / s", f"{comparison.engine_output_tokens_per_s:.1f}"),
                 ("serve ÷ engine", f"{comparison.ratio:.3f}")]
    for name, value in rows:
        totals.add_row(name, value)
    console.print(totals)
