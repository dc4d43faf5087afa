"""`tokenmill bench serve`: load-test an OpenAI-compatible server over HTTP streaming.

Modes (exactly one): `--concurrency N` keeps N streams in flight for --num-requests;
`--request-rate R` sends --num-requests as a seeded Poisson process of R requests/s;
`--trace PATH` replays a Mooncake JSONL trace (arrivals, lengths and prefix sharing).
Prompts are token ids in [--min-token-id, --vocab-size): the server's /v1/models does not
say the vocabulary size, so give --vocab-size for models larger than the tiny presets' 2048
(or use --engine-workload, which reads it from the checkpoint). Outputs use ignore_eos, so
every request generates exactly its asked length. Only --url is ever contacted.
Statistics: `serve_stats`; JSON schema: `serve_report`; the stack-overhead benchmark
(`--engine-workload`, `--compare-engine`, `--mock-step-ms`): `engine_compare`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tokenmill.bench.harness import loadgen
from tokenmill.bench.harness.report_file import write_json
from tokenmill.bench.harness.serve_report import EngineComparison, render_table, report_json
from tokenmill.bench.harness.serve_stats import SLO, summarize
from tokenmill.bench.harness.trace_replay import TraceFit, read_trace, trace_requests
from tokenmill.workloads.prompt_synth import (
    HashBlockSynth,
    RequestSpec,
    SyntheticShape,
    TokenSpace,
    poisson_arrivals,
    random_tokens,
    synthetic_requests,
)

log = logging.getLogger(__name__)

WARMUP_OUTPUT_TOKENS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model id (as /v1/models lists it)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, help="closed loop: N streams in flight")
    mode.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals, requests/s")
    mode.add_argument("--trace", help="open loop: replay a Mooncake-format JSONL trace")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    _add_workload_arguments(parser)
    _add_report_arguments(parser)


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    lengths = parser.add_argument_group("synthetic prompts (not --trace)")
    lengths.add_argument("--input-len", type=int, help="fixed prompt length (sets --min-input and --max-input)")
    lengths.add_argument("--output-len", type=int, help="fixed output length (sets --min-output and --max-output)")
    for name, default in (("min-input", 32), ("max-input", 1024), ("min-output", 16), ("max-output", 256)):
        lengths.add_argument(f"--{name}", type=int, default=default, help="uniform range, inclusive")
    lengths.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens before each prompt")
    lengths.add_argument("--num-prefix-groups", type=int, default=1, help="distinct shared prefixes")
    lengths.add_argument("--vocab-size", type=int, default=2048, help="token ids stay below this")
    lengths.add_argument("--min-token-id", type=int, default=3, help="token ids start here (skip specials)")
    trace = parser.add_argument_group("trace replay")
    trace.add_argument("--tokens-per-hash-block", type=int, default=512, help="tokens per trace hash id")
    trace.add_argument("--time-scale", type=float, default=1.0, help="multiplies inter-arrival times")
    for name in ("max-requests", "max-input-tokens", "max-output-tokens"):
        trace.add_argument(f"--{name}", type=int, default=None, help="cap (trace mode)")


def _add_report_arguments(parser: argparse.ArgumentParser) -> None:
    report = parser.add_argument_group("report")
    report.add_argument("--slo-ttft-ms", type=float, default=None)
    report.add_argument("--slo-itl-ms", type=float, default=None, help="applies to each request's mean ITL")
    report.add_argument("--usd-per-hour", type=float, default=None, help="the fleet's price, for cost per token")
    report.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")
    report.add_argument("--save-requests", action="store_true", help="include per-request records in --json")
    report.add_argument("--quiet", action="store_true", help="no progress bar")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--timeout-s", type=float, default=300.0, help="deadline of each request")
    limits.add_argument("--max-duration-s", type=float, default=3600.0, help="deadline of the whole run")
    limits.add_argument("--warmup-requests", type=int, default=1, help="short requests sent first, not counted")
    overhead = parser.add_argument_group("stack overhead (see tokenmill.bench.serving.engine_compare)")
    overhead.add_argument("--engine-workload", metavar="MODEL_DIR", help="send `bench engine`'s workload")
    overhead.add_argument("--compare-engine", metavar="ENGINE_JSON", help="`bench engine --json` output")
    overhead.add_argument("--mock-step-ms", type=float, default=None,
                          help="the server's fixed mock step time: report TPOT minus it per token")
    overhead.add_argument("--mock-reference", action="store_true",
                          help="run the workload in-process through the mock engine first and subtract "
                               "its wall step instead (needs --mock-step-ms, --engine-workload, --concurrency)")


def _validate(args: argparse.Namespace) -> None:
    if not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    args.url = args.url.rstrip("/")
    for name in ("concurrency", "request_rate", "num_requests", "timeout_s", "max_duration_s"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.warmup_requests < 0:
        raise ValueError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if args.usd_per_hour is not None and args.usd_per_hour < 0:
        raise ValueError(f"--usd-per-hour must be >= 0, got {args.usd_per_hour}")
    if args.compare_engine and not args.engine_workload:
        raise ValueError("--compare-engine needs --engine-workload (the same workload on both sides)")
    if args.mock_reference and (args.mock_step_ms is None or not args.engine_workload or not args.concurrency):
        raise ValueError("--mock-reference needs --mock-step-ms, --engine-workload and --concurrency")
    if args.compare_engine and args.mock_reference:
        raise ValueError("--compare-engine and --mock-reference are two baselines; give one")
    if args.engine_workload and args.trace:
        raise ValueError("--engine-workload and --trace are different workloads; give one")
    if args.input_len is not None:
        args.min_input = args.max_input = args.input_len
    if args.output_len is not None:
        args.min_output = args.max_output = args.output_len


def _length_flags(args: argparse.Namespace) -> dict[str, int]:
    return {name: getattr(args, name) for name in
            ("num_requests", "min_input", "max_input", "min_output", "max_output", "seed")}


def build_requests(args: argparse.Namespace) -> list[RequestSpec]:
    space = TokenSpace(args.vocab_size, args.min_token_id)
    if args.trace:
        fit = TraceFit(args.time_scale, args.max_requests, args.max_input_tokens, args.max_output_tokens)
        synth = HashBlockSynth(space, args.tokens_per_hash_block, args.seed)
        return trace_requests(read_trace(args.trace, args.max_requests), synth, fit)
    if args.engine_workload:
        from tokenmill.bench.serving.engine_compare import engine_workload_specs

        specs = engine_workload_specs(args.engine_workload, _length_flags(args))
    else:
        shape = SyntheticShape(args.min_input, args.max_input, args.min_output, args.max_output,
                               args.prefix_len, args.num_prefix_groups)
        specs = synthetic_requests(args.num_requests, shape, space, args.seed)
    if args.request_rate is not None:
        poisson_arrivals(specs, args.request_rate, args.seed)
    return specs


def _check_fits(specs: list[RequestSpec], card: dict[str, Any]) -> None:
    limit = card.get("max_model_len")
    longest = max(len(s.prompt) + s.output_len for s in specs)
    if isinstance(limit, int) and longest > limit:
        raise ValueError(f"a request needs {longest} tokens but the server's context is {limit}: lower "
                         "--max-input/--max-output (or --max-input-tokens/--max-output-tokens with --trace)")


async def _warm_up(client: httpx.AsyncClient, target: loadgen.Target, args: argparse.Namespace) -> None:
    import numpy as np

    space = TokenSpace(args.vocab_size, args.min_token_id)
    rng = np.random.default_rng([args.seed, 2])  # short and unique: never a cached prefix of the workload
    for _ in range(args.warmup_requests):
        record = loadgen.RequestRecord(-1, 8, WARMUP_OUTPUT_TOKENS)
        spec = RequestSpec(random_tokens(rng, space, 8), WARMUP_OUTPUT_TOKENS)
        await loadgen.send_one(client, target, spec, record, 0.0)
        if record.status != loadgen.OK:
            log.warning("warm-up request failed: %s %s", record.status, record.error)


async def _drive(args: argparse.Namespace, specs: list[RequestSpec], on_done: loadgen.Progress,
                 ) -> list[loadgen.RequestRecord]:
    target = loadgen.Target(args.url, args.model, args.timeout_s)
    async with loadgen.make_client(args.concurrency) as client:
        _check_fits(specs, await loadgen.fetch_model_card(client, args.url, args.model))
        await _warm_up(client, target, args)
        records = loadgen.new_records(specs)
        try:
            async with asyncio.timeout(args.max_duration_s):
                if args.concurrency is not None:
                    await loadgen.run_closed_loop(client, target, specs, records, args.concurrency, on_done)
                else:
                    await loadgen.run_open_loop(client, target, specs, records, on_done)
        except TimeoutError:
            log.warning("--max-duration-s %.0f reached: in-flight requests cancelled", args.max_duration_s)
    return records


def _run_with_progress(args: argparse.Namespace, specs: list[RequestSpec]) -> list[loadgen.RequestRecord]:
    if args.quiet or not sys.stderr.isatty():
        return asyncio.run(_drive(args, specs, lambda record: None))
    columns = (TextColumn("bench serve"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("requests", total=len(specs))
        return asyncio.run(_drive(args, specs, lambda record: progress.advance(task)))


def _config_json(args: argparse.Namespace) -> dict[str, Any]:
    mode = "concurrency" if args.concurrency is not None else "request_rate" if args.request_rate else "trace"
    plain = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
    return {"mode": mode, **plain}


def _engine_reference(args: argparse.Namespace, specs: list[RequestSpec]) -> tuple[float | None, float | None]:
    """(engine output tokens/s to compare with, per-token baseline ms for the overhead)."""
    from tokenmill.bench.serving import engine_compare

    if args.compare_engine:
        return engine_compare.engine_tokens_per_s(args.compare_engine, _length_flags(args)), args.mock_step_ms
    if args.mock_reference:
        log.info("in-process mock engine reference: %d requests", len(specs))
        return engine_compare.mock_engine_reference(args.engine_workload, specs, args.mock_step_ms,
                                                    args.concurrency)
    return None, args.mock_step_ms


def run(args: argparse.Namespace) -> int:
    """0 when every request completed, 1 when some did not, 2 for bad flags or an unusable server."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))  # a line per request
    try:
        _validate(args)
        specs = build_requests(args)
        slo = SLO(args.slo_ttft_ms, args.slo_itl_ms)
        engine_tps, baseline_step_ms = _engine_reference(args, specs)
        records = _run_with_progress(args, specs)
    except (ValueError, FileNotFoundError) as exc:
        log.error("bench serve: %s", exc)
        return 2
    summary = summarize(records, slo, args.usd_per_hour, baseline_step_ms)
    comparison: EngineComparison | None = None
    if engine_tps is not None:
        from tokenmill.bench.serving.engine_compare import compare

        source = args.compare_engine or "in-process mock engine (--mock-reference)"
        comparison = compare(source, engine_tps, summary.output_token_throughput)
    render_table(summary, comparison, Console())
    if args.json_path:
        report = report_json(_config_json(args), specs, summary, comparison,
                             records if args.save_requests else None)
        write_json(report, args.json_path)
        log.info("wrote %s", args.json_path)
    return 0 if summary.requests_ok == summary.requests_total else 1
