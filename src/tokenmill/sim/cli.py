"""`tokenmill sim`: estimate, search, report, validate, calibrate, fleet."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tokenmill.sim.pareto import DEFAULT_USD_PER_GPU_HOUR

log = logging.getLogger(__name__)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="built-in name or HF config.json path")
    p.add_argument("--gpu", required=True, help="h100 h200 b200 b300 gb200 gb300 cpu-local")
    p.add_argument("--precision", default="fp8", help="bf16 | fp8 | fp4 (weights/activations; KV fp8 unless bf16)")
    p.add_argument("--kv-precision", default=None, help="override the KV-cache format")
    p.add_argument("--backend", default=None, help="use this framework's fitted tuning (trtllm, vllm, sglang; default trtllm)")
    p.add_argument("--isl", type=int, required=True, help="input tokens per request")
    p.add_argument("--osl", type=int, required=True, help="output tokens per request")
    p.add_argument("--mtp", type=int, default=0, help="multi-token-prediction draft tokens per step")
    p.add_argument("--mtp-acceptance", type=float, default=1.0, help="tokens emitted per decode step")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", metavar="SIM_COMMAND", required=True)
    est = sub.add_parser("estimate", help="one aggregated deployment")
    _add_common(est)
    for name in ("tp", "pp", "ep", "dp"):
        est.add_argument(f"--{name}", type=int, default=1)
    est.add_argument("--batch", type=int, required=True, help="requests in flight on the instance")
    est.add_argument("--json", action="store_true", help="print the JSON contract only")
    srch = sub.add_parser("search", help="search deployments for a GPU budget")
    _add_common(srch)
    srch.add_argument("--gpus", type=int, required=True, help="GPU budget")
    srch.add_argument("--ttft-ms", type=float, default=None)
    srch.add_argument("--itl-ms", type=float, default=None)
    srch.add_argument("--usd-per-gpu-hour", type=float, default=DEFAULT_USD_PER_GPU_HOUR)
    srch.add_argument("--power-cap-kw", type=float, default=None,
                      help="only deployments whose GPUs draw at most this (the catalog's power per GPU)")
    srch.add_argument("--json", dest="json_out", type=Path, default=None, help="write results to this JSON file")
    srch.add_argument("--plot", type=Path, default=None, help="write the frontier PNG here")
    rep = sub.add_parser("report", help="trend study: PNG plots + markdown summary")
    rep.add_argument("--out", type=Path, required=True)
    val = sub.add_parser("validate", help="every validation case, with error and pass/fail")
    val.add_argument("--data", default=None, help="data dir laid out like ../shared/data, or the silicon CSV itself (default: the shipped copy)")
    val.add_argument("--refit", nargs="?", const="all", choices=("all", "ttft"), default=None,
                     help="refit on the training split first: every tuning (all), or only the per-model TTFT fields "
                          "on top of the stored framework tunings (ttft)")
    val.add_argument("--fitted-out", type=Path, default=None, help="where --refit writes (default: package data)")
    val.add_argument("--json", dest="json_out", type=Path, default=None)
    cal = sub.add_parser("calibrate", help="measure this machine into a cpu-local GPU entry")
    cal.add_argument("--out", type=Path, default=None, help="default ~/.cache/tokenmill/cpu-local.json")
    cal.add_argument("--quick", action="store_true", help="shorter measurements")
    cal.add_argument("--model", default=None, help="also fit the step-time model to tokenmill's engine on this checkpoint")
    cal.add_argument("--threads", type=int, default=1, help="torch threads of the engine timed with --model (as each worker)")
    from tokenmill.sim.fleet import cli as fleet_cli

    fleet_cli.add_arguments(sub)


def run(args: argparse.Namespace) -> int:
    from tokenmill.sim import commands
    from tokenmill.sim.fleet.cli import fleet_cmd

    handlers = {"estimate": commands.estimate_cmd, "search": commands.search_cmd, "report": commands.report_cmd,
                "validate": commands.validate_cmd, "calibrate": commands.calibrate_cmd, "fleet": fleet_cmd}
    try:
        return handlers[args.sim_command](args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
