"""`tokenmill bench disagg`: prefill/decode interference, aggregated vs disaggregated serving.

The disaggregation benchmark. One seeded open-loop workload is sent, with the same prompts and the same
Poisson arrival times, to two fresh `tokenmill serve` deployments on this host, one after the other:

- aggregated (`--agg-flags`, default `--workers 2 --threads 1`): both workers prefill and decode,
  so a long prompt's prefill stalls the decodes batched with it;
- disaggregated (`--disagg-flags`, default `--prefill 1 --decode 1 --threads 1
  --disagg-threshold 0`): one worker prefills every prompt, the other only decodes (pass
  `--disagg-threshold 256` to measure conditional disaggregation, where short prompts are
  prefilled on the decode worker), so decode steps are never stretched by a long prefill.

Each worker is one process with one torch thread, so both arms use two cores. `--engine vllm` runs
both arms on vLLM workers (its venv, `make install-vllm`; the default model is then the small-llama
preset): the disaggregated arm's KV moves through tokenmill's vLLM connector. The mix:
`--long-fraction` (20%) of the requests carry `--long-prompt` (1,500) random tokens, the rest
`--short-prompt` (64); every answer is exactly `--output-len` (128) tokens (ignore_eos). Exactly
round(fraction × N) requests are long, at seeded positions, so small runs keep the mix.

Figures per arm (definitions in `tokenmill.bench.harness.serve_stats`): TTFT (overall and per prompt
class: disaggregation trades long prompts' TTFT for short prompts' ITL), ITL (gaps between a
stream's successive token events, pooled over requests), output tokens/s (first send to last
stream end), and, to judge whether the rate keeps the two cores busy with a stable queue: the
workers' and the frontend's CPU utilisation (from /proc), the CPU the rest of the host used
meanwhile (the box may be shared: then latencies are inflated), the mean number of requests in
flight, and whether short prompts' TTFT grows through the run (a growing queue). For the disaggregated arm the
`tokenmill_disagg_decisions_total{decision,reason}` counters of /metrics are reported when the
server exports them. Targets: disaggregated p99 ITL ≤ 0.5× aggregated, output tokens/s ≥ 0.75×.

JSON written by `--json OUT` (schema "tokenmill.bench.disagg", version 1; times in seconds
unless the key ends in _ms; distributions are {count, mean, p50, p90, p99, max} or null):

    {
      "schema": "tokenmill.bench.disagg", "schema_version": 1,
      "config": {every flag: model, num_requests, rate, seed, long_prompt, short_prompt,
                 long_fraction, output_len, agg_flags, disagg_flags, arms, warmup_requests, ...},
      "workload": {num_requests, long_requests, short_requests, prompt_tokens, output_tokens,
                   arrival_span_s, offered_prompt_tokens_per_s, offered_output_tokens_per_s},
      "arms": {"aggregated" | "disaggregated": {
                 serve_flags [str], results {bench serve's summary: duration_s, requests_ok,
                 outcomes, length_mismatches, output_token_throughput, ttft_ms, itl_ms, tpot_ms, ...},
                 by_class {"long" | "short": {requests, ttft_ms, itl_ms}},
                 load {drain_s (last stream end − last arrival: includes its own answer),
                       mean_in_flight (Σ e2e ÷ duration), short_ttft_late_over_early (median TTFT of
                       the last third of short prompts ÷ the first third's: ≫ 1 = a growing queue),
                       worker_cpu_utilization {"worker-id (role)": cores used}, frontend_cpu_utilization,
                       client_cpu_utilization (this load generator), other_processes_cpu_cores (the rest of
                       the host meanwhile: well above 0 means the cores were shared and figures inflated),
                       server_events: null or {worker_drops, migrations} (from the serve log, warm-up
                       included: a dropped worker's streams are recomputed elsewhere, inflating latencies)},
                 disagg_decisions: null (no such counters) or [{decision, reason, count}] (this run only),
                 requests: only with --save-requests: [bench serve's per-request rows + "class"]}},
      "comparison": null (an arm missing) or {p99_itl_ratio, p99_itl_target_max, p99_itl_met,
                    output_tokens_per_s_ratio, output_tokens_per_s_target_min, output_tokens_per_s_met}
    }
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the bench modules pull numpy and httpx: only `run` imports them
    import httpx

    from tokenmill.bench.harness.loadgen import Target
    from tokenmill.bench.harness.serve_process import ServeProcess
    from tokenmill.workloads.prompt_synth import RequestSpec

from tokenmill.bench.harness.serve_observe import (
    count_server_events,
    cpu_snapshot,
    decisions_delta,
    fetch_decisions,
)
from tokenmill.bench.kv.disagg_figures import (
    AGGREGATED,
    DISAGGREGATED,
    ArmRun,
    arm_json,
    comparison_json,
)
from tokenmill.bench.kv.disagg_workload import (
    DEFAULT_PRESET,
    MODEL_CACHE,
    PRESETS,
    Mix,
    build_workload,
    model_shape,
    resolve_model,
    warmup_requests,
    workload_json,
)

log = logging.getLogger(__name__)

SCHEMA_NAME = "tokenmill.bench.disagg"
SCHEMA_VERSION = 1
DEFAULT_AGG_FLAGS = "--workers 2 --threads 1"
DEFAULT_DISAGG_FLAGS = "--prefill 1 --decode 1 --threads 1 --disagg-threshold 0"
# 1.5 req/s = 192 output + 527 prompt tokens/s offered. Each aggregated worker then holds ~4-5
# streams, so it never idles, at about half its capacity (~3 req/s for the pair); the lone decode
# worker of 1P+1D, which carries every answer, runs at roughly two thirds of its own (~2.2 req/s).
# Higher rates grow the disaggregated queue, and the tok/s comparison would measure overload
# rather than interference. From CPU-normalised runs on the shared 2-core box (2026-11-30).
DEFAULT_RATE = 1.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"checkpoint dir (default: {DEFAULT_PRESET} under {MODEL_CACHE}, made if missing)")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=DEFAULT_RATE, help="Poisson arrivals, requests/s")
    parser.add_argument("--seed", type=int, default=0)
    mix = parser.add_argument_group("workload mix (defaults)")
    mix.add_argument("--long-prompt", type=int, default=1500, help="tokens in a long prompt")
    mix.add_argument("--short-prompt", type=int, default=64, help="tokens in a short prompt")
    mix.add_argument("--long-fraction", type=float, default=0.2, help="share of requests with a long prompt")
    mix.add_argument("--output-len", type=int, default=128, help="exact answer length of every request")
    arms = parser.add_argument_group("deployments")
    arms.add_argument("--agg-flags", default=DEFAULT_AGG_FLAGS, help="`tokenmill serve` flags, aggregated arm")
    arms.add_argument("--disagg-flags", default=DEFAULT_DISAGG_FLAGS,
                      help="`tokenmill serve` flags, disaggregated arm (e.g. add --disagg-threshold 0)")
    arms.add_argument("--arms", choices=("both", "agg", "disagg"), default="both",
                      help="run one arm only (calibration); the comparison needs both")
    arms.add_argument("--engine", choices=tuple(PRESETS), default="own",
                      help="both arms' workers: tokenmill's own engine, or vLLM (from .venv-vllm; its KV moves "
                           "through tokenmill's connector; default model: the small-llama preset, a toy whose "
                           "steps are mostly overhead: --model .models/smollm2-135m-instruct for a 135M model)")
    arms.add_argument("--start-timeout-s", type=float, default=180.0)
    run_group = parser.add_argument_group("run and report")
    run_group.add_argument("--warmup-requests", type=int, default=4,
                           help="requests sent to each server before measuring (half short, half long)")
    run_group.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each request")
    run_group.add_argument("--max-duration-s", type=float, default=1800.0, help="deadline of each arm's run")
    run_group.add_argument("--work-dir", default=None,
                           help="keep each arm's serve log and run dir here (default: a temp dir, removed)")
    run_group.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")
    run_group.add_argument("--save-requests", action="store_true", help="per-request rows in --json")
    run_group.add_argument("--quiet", action="store_true", help="no progress bar")


# --------------------------------------------------------------------------- servers

def expected_workers(flags: Sequence[str]) -> int:
    """Worker processes the flags start: --prefill + --decode when given, else --workers (default 1)."""
    parser = argparse.ArgumentParser(add_help=False)
    for name in ("--workers", "--prefill", "--decode"):
        parser.add_argument(name, type=int, default=None)
    known, _ = parser.parse_known_args(list(flags))
    if known.prefill is not None or known.decode is not None:
        return (known.prefill or 0) + (known.decode or 0)
    return known.workers or 1


@contextmanager
def serving(model: Path, flags: Sequence[str], work_dir: Path, start_timeout_s: float) -> Iterator[ServeProcess]:
    """`tokenmill serve --model M *flags` on a free port, healthy with all its workers, always stopped."""
    from tokenmill.bench.harness.serve_process import running_server

    work_dir.mkdir(parents=True, exist_ok=True)
    log.info("starting tokenmill serve %s", shlex.join(flags))
    with running_server(["--model", str(model), *flags], expected_workers(flags), work_dir / "run",
                        work_dir / "serve.log", start_timeout_s) as server:
        yield server


# --------------------------------------------------------------------------- one arm

async def served_model(client: httpx.AsyncClient, url: str) -> str:
    resp = await client.get(f"{url}/v1/models", timeout=10.0)
    resp.raise_for_status()
    cards = resp.json().get("data") or []
    if not cards:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return str(cards[0]["id"])


async def warm_up(client: httpx.AsyncClient, target: Target, specs: Sequence[RequestSpec]) -> None:
    """Concurrently, so each worker of either arm sees some (kernels, allocator, transfer path)."""
    from tokenmill.bench.harness import loadgen

    records = [loadgen.RequestRecord(-1, len(s.prompt), s.output_len) for s in specs]
    await asyncio.gather(*(loadgen.send_one(client, target, s, r, 0.0) for s, r in zip(specs, records)))
    for record in records:
        if record.status != loadgen.OK:
            log.warning("warm-up request failed: %s %s", record.status, record.error)


async def measure(server: ServeProcess, name: str, flags: list[str], specs: Sequence[RequestSpec],
                  warmups: Sequence[RequestSpec], args: argparse.Namespace, on_done: Any) -> ArmRun:
    from tokenmill.bench.harness import loadgen

    async with loadgen.make_client(None) as client:  # open loop: no cap on streams in flight
        target = loadgen.Target(server.url, await served_model(client, server.url), args.timeout_s)
        await warm_up(client, target, warmups)
        decisions_before = await fetch_decisions(client, server.url)
        cpu_before, window_start = cpu_snapshot(server), time.perf_counter()
        records = loadgen.new_records(specs)
        try:
            async with asyncio.timeout(args.max_duration_s):
                await loadgen.run_open_loop(client, target, specs, records, on_done)
        except TimeoutError:
            log.warning("%s: --max-duration-s %.0f reached, in-flight requests cancelled", name, args.max_duration_s)
        cpu_after, window = cpu_snapshot(server), time.perf_counter() - window_start
        decisions = decisions_delta(decisions_before, await fetch_decisions(client, server.url))
    used = {k: cpu_after[k] - v for k, v in cpu_before.items()
            if v is not None and cpu_after.get(k) is not None}
    return ArmRun(name, flags, records, used, window, decisions)


def run_arm(name: str, flags: list[str], model: Path, specs: Sequence[RequestSpec],
            warmups: Sequence[RequestSpec], args: argparse.Namespace, work_dir: Path) -> ArmRun:
    with serving(model, flags, work_dir / name, args.start_timeout_s) as server:
        log.info("%s: %d workers healthy at %s; warming up", name, server.num_workers, server.url)
        with progress_bar(name, len(specs), args.quiet) as on_done:
            arm = asyncio.run(measure(server, name, flags, specs, warmups, args, on_done))
    arm.server_events = count_server_events(work_dir / name / "serve.log")
    ok = sum(1 for r in arm.records if r.status == "ok")
    log.info("%s: %d/%d requests ok", name, ok, len(arm.records))
    return arm


@contextmanager
def progress_bar(name: str, total: int, quiet: bool) -> Iterator[Any]:
    """A per-request callback that advances a bar on a terminal, and does nothing otherwise."""
    if quiet or not sys.stderr.isatty():
        yield lambda record: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(f"bench disagg: {name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(name, total=total)
        yield lambda record: progress.advance(task)


# --------------------------------------------------------------------------- table

def _validate(args: argparse.Namespace, mix: Mix, context_len: int) -> None:
    for name in ("rate", "timeout_s", "max_duration_s", "start_timeout_s"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.warmup_requests < 0:
        raise ValueError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    longest = max(mix.long_prompt, mix.short_prompt) + mix.output_len
    if context_len and longest > context_len:
        raise ValueError(f"a request needs {longest} tokens but the model's context is {context_len}")


def _arm_flags(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    from tokenmill.bench.harness.serve_process import VLLM_SERVE_FLAGS

    engine = [*VLLM_SERVE_FLAGS, "--engine-arg", "dtype=float32"] if args.engine == "vllm" else []
    arms = [(AGGREGATED, shlex.split(args.agg_flags) + engine), (DISAGGREGATED, shlex.split(args.disagg_flags) + engine)]
    keep = {"both": (AGGREGATED, DISAGGREGATED), "agg": (AGGREGATED,), "disagg": (DISAGGREGATED,)}[args.arms]
    return [(name, flags) for name, flags in arms if name in keep]


@contextmanager
def _work_dir(keep: str | None) -> Iterator[Path]:
    if keep is not None:
        Path(keep).mkdir(parents=True, exist_ok=True)
        # a fresh directory per run: a stale registry from an earlier run would confuse the health wait
        yield Path(tempfile.mkdtemp(prefix="disagg-", dir=keep))
        return
    with tempfile.TemporaryDirectory(prefix="tm-disagg-") as tmp:
        yield Path(tmp)


def _config_json(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    plain = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
    return {**plain, "model": str(model)}


def run(args: argparse.Namespace) -> int:
    """0 when every request of every arm completed, 1 when some did not, 2 for bad flags or a server
    that would not start. Missed targets are results, not failures."""
    import httpx

    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))  # a line per request
    try:
        mix = Mix(args.num_requests, args.long_prompt, args.short_prompt, args.long_fraction, args.output_len)
        model = resolve_model(args.model, args.engine)
        vocab_size, context_len = model_shape(model)
        _validate(args, mix, context_len)
        specs, classes = build_workload(mix, args.rate, args.seed, vocab_size)
        warmups = warmup_requests(mix, args.warmup_requests, args.seed, vocab_size)
        with _work_dir(args.work_dir) as work:
            runs = [run_arm(name, flags, model, specs, warmups, args, work) for name, flags in _arm_flags(args)]
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:  # bad flags, or a server unfit to measure
        log.error("bench disagg: %s", exc)
        return 2
    workload = workload_json(specs, classes)
    arms = {arm.name: arm_json(arm, classes, workload["arrival_span_s"], args.save_requests) for arm in runs}
    report = {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, "config": _config_json(args, model),
              "workload": workload, "arms": arms, "comparison": comparison_json(arms)}
    from tokenmill.bench.kv.disagg_report import render

    render(report)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log.info("wrote %s", args.json_path)
    complete = all(a["results"]["requests_ok"] == a["results"]["requests_total"] for a in arms.values())
    return 0 if complete else 1
