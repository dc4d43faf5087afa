"""`tokenmill bench tenants`: an interactive tenant beside a batch tenant's flood, on a mock GPU fleet.

Each run is a fresh `tokenmill serve --runner mock --mock-profile P --workers W --max-num-seqs S
--tenants FILE --max-in-flight ceil(W*S/0.8) --batch-share 0.8`: batch requests may fill the workers and no
more. The interactive tenant sends `--interactive-rate` requests a
second (Poisson, seeded) for `--duration-s`; in the flood runs the batch tenant keeps `--flood`
times the fleet's W*S slots of requests in flight meanwhile (closed loop), so the frontend's queue
and the workers both stay full. Three modes, each `--repeats` times, in turn (each repeat starts
one mode further along), every run after a few unmeasured interactive requests (a fresh server's
first steps are slow):

- `unloaded`: the interactive tenant alone (its TTFT without the flood);
- `one-class`: both tenants `standard` with equal weights (fair shares, no priorities);
- `classes`: the interactive tenant `interactive`, the batch one `batch` (the queue lets the
  interactive requests go first, and the engine admits, schedules and preempts by class).

Printed and written (`--json`, schema "tokenmill.bench.tenants" v1): per mode, the interactive
TTFT p50/p90 (ms) and its p90 over the same repeat's unloaded one (the target: at most 1.5 with
classes, every interactive request answered), the batch tenant's completed requests and the output tok/s it and
the whole fleet streamed, and the fleet's utilisation (its workers' step time over the run's wall
time, `tokenmill_worker_busy_seconds_total`); beside them the same three modes in the fleet simulator
(`tenants_sim.py`: the same fleet, tenants, slots and arrivals, priced by the mock profile's own
step-time model), so the simulator's account of classes is checked against the live one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from tokenmill.bench.harness import loadgen
from tokenmill.bench.harness.checkpoint import model_limits
from tokenmill.bench.harness.serve_process import running_server
from tokenmill.bench.harness.serve_stats import Distribution, distribution_ms
from tokenmill.bench.serving.tenants_sim import simulate_mode
from tokenmill.workloads.prompt_synth import RequestSpec

log = logging.getLogger(__name__)

SCHEMA_NAME, SCHEMA_VERSION = "tokenmill.bench.tenants", 1
MODES = ("unloaded", "one-class", "classes")
P90_TARGET = 1.5  # interactive TTFT p90 under the flood, over unloaded, with classes
SERVED_NAME = "tenants"
KEYS = {"assistant": "k-assistant", "sweeps": "k-sweeps"}
BATCH_SHARE = 0.8
WARMUP_REQUESTS = 4  # unmeasured, one at a time, before each run's load


@dataclass(slots=True)
class ModeRun:
    mode: str
    repeat: int
    interactive_ok: int
    interactive_sent: int
    interactive_ttft: Distribution | None
    batch_ok: int
    batch_output_tok_s: float
    fleet_output_tok_s: float
    fleet_utilisation: float | None = None  # the workers' step time over the run's wall time, all workers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir for the tokenizer (default: tiny-llama in a "
                                                      "temp dir; the mock runner reads no weights)")
    parser.add_argument("--mock-profile", default="llama-3.1-70b@h100:fp8:tp4", help="the mock workers' GPU clock")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="each worker's step budget (a GPU's: a prompt and the running decodes fit one step)")
    parser.add_argument("--flood", type=float, default=5.0, help="batch requests in flight, times the fleet's slots")
    parser.add_argument("--interactive-rate", type=float, default=2.0, help="interactive requests a second")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--interactive-output-tokens", type=int, default=32)
    parser.add_argument("--batch-output-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode, the three in turn")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="deadline of each request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write results here")


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    runs: list[ModeRun] = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-tenants-") as tmp:
        work = Path(tmp)
        try:
            _validate(args)
            model = _model(args, work)
            _, vocab = model_limits(str(model))
        except ValueError as exc:
            print(f"error: {exc}")
            return 2
        order = [(mode, r) for r in range(args.repeats) for mode in MODES[r % 3:] + MODES[:r % 3]]
        for mode, repeat in order:
            log.info("tenants bench: %s, repeat %d", mode, repeat)
            runs.append(_run_mode(args, model, vocab, mode, repeat, work / f"{mode}-{repeat}"))
    slots = math.ceil(args.workers * args.max_num_seqs / BATCH_SHARE)
    arrivals = [spec.arrival_s for spec in _interactive_specs(args, vocab, 0)]
    simulated = [simulate_mode(args, mode, arrivals, slots, BATCH_SHARE, _classes(mode)) for mode in MODES]
    report = _report(args, runs, simulated)
    _print(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


def _validate(args: argparse.Namespace) -> None:
    for name in ("workers", "max_num_seqs", "max_num_batched_tokens", "flood", "interactive_rate", "duration_s",
                 "prompt_tokens", "interactive_output_tokens", "batch_output_tokens", "repeats", "timeout_s"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")


def _model(args: argparse.Namespace, work: Path) -> Path:
    if args.model is not None:
        return Path(args.model)
    from tokenmill.bench.harness.checkpoint import fit_context
    from tokenmill.engine.make_model import write_model

    model = write_model("tiny-llama", work / "tiny-llama", seed=0)
    fit_context(model, args.prompt_tokens + max(args.interactive_output_tokens, args.batch_output_tokens) + 16, True)
    return model


def _classes(mode: str) -> dict[str, str]:
    if mode == "classes":
        return {"assistant": "interactive", "sweeps": "batch"}
    return {"assistant": "standard", "sweeps": "standard"}


def _tenants_file(mode: str, path: Path) -> Path:
    path.write_text("".join(f'[tenants.{name}]\nkeys = ["{KEYS[name]}"]\nclass = "{cls}"\n\n'
                            for name, cls in _classes(mode).items()))
    return path


def _run_mode(args: argparse.Namespace, model: Path, vocab: int, mode: str, repeat: int, run_dir: Path) -> ModeRun:
    run_dir.mkdir(parents=True)
    slots = args.workers * args.max_num_seqs
    # batch requests may fill the workers' slots and no more: the rest of the frontend's is the others'
    frontend_slots = math.ceil(slots / BATCH_SHARE)
    flags = ["--model", str(model), "--served-model-name", SERVED_NAME, "--runner", "mock",
             "--mock-profile", args.mock_profile, "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--tenants", str(_tenants_file(mode, run_dir / "tenants.toml")),
             "--max-in-flight", str(frontend_slots), "--batch-share", str(BATCH_SHARE),
             "--queue-timeout-s", str(args.timeout_s), "--seed", str(args.seed)]
    with running_server(flags, args.workers, run_dir / "run", run_dir / "serve.log") as server:
        return asyncio.run(_drive(args, server.url, vocab, mode, repeat, slots))


async def _drive(args: argparse.Namespace, url: str, vocab: int, mode: str, repeat: int, slots: int) -> ModeRun:
    rng = random.Random(f"batch-{args.seed}-{repeat}")  # the flood's prompts: a stream of their own
    interactive_specs = _interactive_specs(args, vocab, repeat)
    flood = 0 if mode == "unloaded" else max(1, round(args.flood * slots))
    batch_specs = [RequestSpec(_prompt(rng, vocab, args.prompt_tokens), args.batch_output_tokens)
                   for _ in range(flood * 50)]  # more than the run can serve: the flood never runs dry
    interactive = loadgen.Target(url, SERVED_NAME, args.timeout_s, KEYS["assistant"])
    batch = loadgen.Target(url, SERVED_NAME, args.timeout_s, KEYS["sweeps"])
    i_records, b_records = loadgen.new_records(interactive_specs), loadgen.new_records(batch_specs)
    async with loadgen.make_client(flood + len(interactive_specs) + 4) as client:
        warmup = [RequestSpec(_prompt(rng, vocab, args.prompt_tokens), 4) for _ in range(WARMUP_REQUESTS)]
        await loadgen.run_closed_loop(client, interactive, warmup, loadgen.new_records(warmup), 1, lambda r: None)
        busy_before = await _busy_seconds(client, url)
        started = time.perf_counter()
        flooding = asyncio.create_task(loadgen.run_closed_loop(client, batch, batch_specs, b_records, flood,
                                                               lambda r: None)) if flood else None
        await loadgen.run_open_loop(client, interactive, interactive_specs, i_records, lambda r: None)
        elapsed = time.perf_counter() - started
        busy = await _busy_seconds(client, url) - busy_before
        if flooding is not None:
            flooding.cancel()
            await asyncio.gather(flooding, return_exceptions=True)
    ok_i = [r for r in i_records if r.status == loadgen.OK]
    ok_b = [r for r in b_records if r.status == loadgen.OK]
    # tokens streamed within the run, the flood's unfinished requests' included (one per event)
    batch_tokens = sum(len(r.token_times_s) for r in b_records)
    all_tokens = batch_tokens + sum(len(r.token_times_s) for r in i_records)
    return ModeRun(mode, repeat, len(ok_i), len(i_records), distribution_ms([r.ttft_s for r in ok_i if r.ttft_s]),
                   len(ok_b), batch_tokens / elapsed, all_tokens / elapsed, busy / (elapsed * args.workers))


async def _busy_seconds(client: httpx.AsyncClient, url: str) -> float:
    """The workers' step time from their start, summed (as their last heartbeats said)."""
    text = (await client.get(url + "/metrics")).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "tokenmill_worker_busy_seconds_total")


def _interactive_specs(args: argparse.Namespace, vocab: int, repeat: int) -> list[RequestSpec]:
    """The interactive tenant's Poisson arrivals (the same for the live and the simulated runs)."""
    rng = random.Random(args.seed * 1000 + repeat)
    specs, t = [], rng.expovariate(args.interactive_rate)
    while t < args.duration_s:
        specs.append(RequestSpec(_prompt(rng, vocab, args.prompt_tokens), args.interactive_output_tokens, t))
        t += rng.expovariate(args.interactive_rate)
    return specs


def _prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


def _report(args: argparse.Namespace, runs: list[ModeRun], simulated: list[dict[str, Any]]) -> dict[str, Any]:
    rows = _over_unloaded([asdict(run) for run in runs])
    classes = [r for r in rows if r["mode"] == "classes"]
    with_classes = [r["p90_over_unloaded"] for r in classes if r["p90_over_unloaded"]]
    worst = max(with_classes) if with_classes and len(with_classes) == len(classes) else None
    every_one = all(r["interactive_ok"] == r["interactive_sent"] for r in classes)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "json_path"}
    return {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, "config": config, "runs": rows,
            "simulated": _over_unloaded([{**row, "interactive_ttft": asdict(row["interactive_ttft"])
                                          if row["interactive_ttft"] else None} for row in simulated]),
            "target": {"p90_over_unloaded_with_classes": P90_TARGET, "worst": worst,
                       "met": worst is not None and worst <= P90_TARGET and every_one}}


def _over_unloaded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its interactive TTFT p90 over the same repeat's unloaded run's."""
    base = {r["repeat"]: (r["interactive_ttft"] or {}).get("p90") for r in rows if r["mode"] == "unloaded"}
    for row in rows:
        p90, unloaded = (row["interactive_ttft"] or {}).get("p90"), base.get(row["repeat"])
        row["p90_over_unloaded"] = p90 / unloaded if p90 and unloaded else None
    return rows


def _print(report: dict[str, Any]) -> None:
    console = Console()
    for key, title in (("runs", "an interactive tenant beside a batch flood (mock GPU fleet)"),
                       ("simulated", "the same in the fleet simulator")):
        console.print(_table(title, report[key]))
    target = report["target"]
    console.print(f"with classes, interactive TTFT p90 / unloaded: worst {target['worst']} "
                  f"(target <= {target['p90_over_unloaded_with_classes']}): {'met' if target['met'] else 'NOT met'}")


def _table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    for column in ("mode", "repeat", "interactive ok", "TTFT p50 ms", "TTFT p90 ms", "p90 / unloaded",
                   "batch ok", "batch tok/s", "fleet tok/s", "fleet util"):
        table.add_column(column, justify="right")
    for r in rows:
        ttft = r["interactive_ttft"] or {}
        ratio = r["p90_over_unloaded"]
        table.add_row(r["mode"], str(r["repeat"]), f"{r['interactive_ok']}/{r['interactive_sent']}",
                      f"{ttft.get('p50', float('nan')):.0f}", f"{ttft.get('p90', float('nan')):.0f}",
                      "-" if ratio is None else f"{ratio:.2f}", str(r["batch_ok"]),
                      f"{r['batch_output_tok_s']:.0f}", f"{r['fleet_output_tok_s']:.0f}",
                      "-" if r["fleet_utilisation"] is None else f"{r['fleet_utilisation']:.0%}")
    return table
