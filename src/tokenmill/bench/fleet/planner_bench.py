"""`tokenmill bench planner`: the SLA planner in the fleet simulator, against static peak and oracle.

For each deployment (`--deployments`, MODEL@GPU:precision:layout, aggregated or `P:D` layouts
for a disaggregated one) and trace (Azure conv and code by default, rate-scaled with
`--rate-scale`), it runs the planner in each mode (sla, load, hybrid) with the default predictor,
and the sla mode with each predictor; beside them the static-peak fleet reaching the sla run's
attainment and the clairvoyant oracle (`planner/simulate.py`). Reported per run: SLA attainment,
GPU-hours, and GPU-hours against the oracle and the static fleet. JSON with `--json OUT`.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
SCHEMA = "tokenmill.bench.planner/1"
DEFAULT_DEPLOYMENTS = "llama-3.1-70b@h100:fp8:tp4"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deployments", default=DEFAULT_DEPLOYMENTS,
                        help="comma list of MODEL@GPU:precision:LAYOUT (aggregated) or "
                             "MODEL@GPU:precision:PREFILL_LAYOUT/DECODE_LAYOUT (disaggregated)")
    parser.add_argument("--traces", default="azure-conv,azure-code",
                        help="comma list: azure-conv, azure-code, or paths")
    parser.add_argument("--rate-scale", type=float, default=8.0)
    parser.add_argument("--max-requests", type=int, default=None, help="the first N requests of each trace")
    parser.add_argument("--ttft-ms", type=float, default=1000.0)
    parser.add_argument("--itl-ms", type=float, default=50.0)
    parser.add_argument("--replica-startup-s", type=float, default=60.0)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="per replica (wide-EP decode wants thousands)")
    parser.add_argument("--prefill-queue-limit", type=int, default=8,
                        help="disaggregated: prefills in flight per prefill replica before decoders prefill locally")
    parser.add_argument("--local-prefill-limit", type=int, default=1,
                        help="disaggregated: ... while a decode replica prefills fewer than this many itself")
    parser.add_argument("--score-from-s", type=float, default=0.0,
                        help="score each run on the requests arriving from this second on (the warm-up left out)")
    parser.add_argument("--modes", default="sla,load,hybrid")
    parser.add_argument("--predictors", default="constant,moving_average,arima,kalman")
    parser.add_argument("--json", dest="json_out", type=Path, default=None)


def _trace_path(name: str) -> str:
    from tokenmill.datasets import AZURE_CODE_TRACE, AZURE_CONV_TRACE, data_file

    return str({"azure-conv": data_file(AZURE_CONV_TRACE), "azure-code": data_file(AZURE_CODE_TRACE)}.get(name, name))


def _args_for(deployment: str, trace: str, args: argparse.Namespace, mode: str, predictor: str) -> argparse.Namespace:
    from tokenmill.planner.simulate import add_arguments as simulate_arguments

    model, _, rest = deployment.partition("@")
    gpu, precision, layout = (rest.split(":") + ["fp8", "tp1"])[:3]
    flags = ["--trace", _trace_path(trace), "--rate-scale", str(args.rate_scale), "--model", model, "--gpu", gpu,
             "--precision", precision, "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms),
             "--replica-startup-s", str(args.replica_startup_s), "--planner", mode, "--predictor", predictor,
             "--max-num-seqs", str(args.max_num_seqs), "--prefill-queue-limit", str(args.prefill_queue_limit),
             "--local-prefill-limit", str(args.local_prefill_limit)]
    if "/" in layout:
        prefill, decode = layout.split("/")
        flags += ["--prefill", "1", "--decode", "1", "--prefill-layout", prefill, "--decode-layout", decode]
    else:
        flags += ["--agg", "1", "--layout", layout]
    if args.max_requests:
        flags += ["--max-requests", str(args.max_requests)]
    if args.score_from_s:
        flags += ["--score-from-s", str(args.score_from_s)]
    parser = argparse.ArgumentParser()
    simulate_arguments(parser)
    return parser.parse_args(flags)


def _row(deployment: str, trace: str, mode: str, predictor: str, args: argparse.Namespace,
         baselines: bool) -> dict[str, Any]:
    from tokenmill.planner.simulate import simulate

    run_args = _args_for(deployment, trace, args, mode, predictor)
    run_args.no_baselines = not baselines
    started = time.perf_counter()
    report = simulate(run_args)
    row = {"deployment": deployment, "trace": trace, "mode": mode, "predictor": predictor,
           "planned": {k: v for k, v in report["planned"].items() if k != "intervals"},
           "wall_s": time.perf_counter() - started}
    for key in ("oracle", "static_peak", "gpu_hours_vs_oracle", "gpu_hours_vs_static"):
        if key in report:
            row[key] = report[key] if not isinstance(report[key], dict) else \
                {k: v for k, v in report[key].items() if k != "intervals"}
    log.info("%s %s %s/%s: attainment %.4f, %.1f GPU-h (%.0f s)", deployment, trace, mode, predictor,
             row["planned"]["sla_attainment"], row["planned"]["gpu_hours"], row["wall_s"])
    return row


def run(args: argparse.Namespace) -> int:
    deployments = [d for d in args.deployments.split(",") if d]
    traces = [t for t in args.traces.split(",") if t]
    modes = [m for m in args.modes.split(",") if m]
    predictors = [p for p in args.predictors.split(",") if p]
    rows = []
    for deployment in deployments:
        for trace in traces:
            rows.append(_row(deployment, trace, "sla", "kalman" if "kalman" in predictors else predictors[0],
                             args, baselines=True))
            base = rows[-1]
            for mode in modes:
                if mode != "sla":
                    rows.append(_with_ratios(_row(deployment, trace, mode, base["predictor"], args, False), base))
            for predictor in predictors:
                if predictor != base["predictor"]:
                    rows.append(_with_ratios(_row(deployment, trace, "sla", predictor, args, False), base))
    report = {"schema": SCHEMA, "config": {k: v for k, v in vars(args).items() if not k.startswith("_")
                                           and isinstance(v, (int, float, str, type(None)))}, "rows": rows}
    _print(rows)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


def _with_ratios(row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    gpu_hours = row["planned"]["gpu_hours"]
    row["gpu_hours_vs_oracle"] = gpu_hours / max(base["oracle"]["gpu_hours"], 1e-9)
    row["gpu_hours_vs_static"] = gpu_hours / max(base["static_peak"]["gpu_hours"], 1e-9)
    return row


def _print(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from tokenmill.planner.simulate_report import misses

    table = Table(title="bench planner (fleet simulator)")
    for col in ("deployment", "trace", "mode", "predictor", "attainment", "TTFT / ITL misses", "GPU-h", "x oracle",
                "x static", "oracle att.", "static fleet", "static att."):
        table.add_column(col, justify="left" if col in ("deployment", "trace", "mode", "predictor") else "right")
    for r in rows:
        p = r["planned"]
        static = r.get("static_peak")
        table.add_row(r["deployment"], r["trace"], r["mode"], r["predictor"], f"{p['sla_attainment']:.2%}", misses(p),
                      f"{p['gpu_hours']:.1f}", f"{r.get('gpu_hours_vs_oracle', float('nan')):.2f}",
                      f"{r.get('gpu_hours_vs_static', float('nan')):.2f}",
                      f"{r['oracle']['sla_attainment']:.2%}" if "oracle" in r else "",
                      str({k: v for k, v in static["fleet"].items() if v}) if static else "",
                      f"{static['sla_attainment']:.2%}" if static else "")
    Console(width=220).print(table)
