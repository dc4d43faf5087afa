"""`tokenmill planner run --url http://frontend …`: the planner as its own process, scaling a
running `tokenmill serve` through its admin API (`planner/live.py`).

    tokenmill planner run --url http://127.0.0.1:8000 --profile llama-3.1-8b@h100:fp8:tp1 \\
        --ttft-ms 1000 --itl-ms 50 --planner sla --json decisions.json

`--profile` is what each replica is (for the performance model): the workers' `--mock-profile`,
or `MODEL_DIR@cpu-local:bf16` after `tokenmill sim calibrate`. Whether the deployment is
disaggregated is read from its workers' roles. Each decision's reason is printed as it is made;
`--json` gets them all at the end (after `--duration-s`, or Ctrl-C).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path

import httpx

from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE
from tokenmill.planner.flags import add_planner_arguments, check_planner_flags
from tokenmill.planner.setup import hold_from, limits_from, make_forecaster, make_planner
from tokenmill.sim.fleet.clock import parse_profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the frontend, e.g. http://127.0.0.1:8000")
    parser.add_argument("--connector", choices=("local", "kubernetes"), default="local",
                        help="local: workers started and drained through the frontend's /admin/workers "
                             "(tokenmill serve); kubernetes: the Deployments' pods, scaled through their "
                             "scale subresource (deploy/k8s)")
    parser.add_argument("--namespace", default="tokenmill", help="kubernetes: the deployment's namespace")
    parser.add_argument("--deployment-prefix", default="tokenmill",
                        help="kubernetes: the worker Deployments are PREFIX-prefill, PREFIX-decode, PREFIX-agg")
    parser.add_argument("--admin-api-key", default=os.environ.get("TOKENMILL_ADMIN_API_KEY"),
                        help="Bearer key of /admin (default: $TOKENMILL_ADMIN_API_KEY)")
    parser.add_argument("--profile", required=True, help="MODEL@GPU[:precision][:layout] of every replica")
    parser.add_argument("--prefill-profile", default=None, help="prefill replicas, if they differ")
    parser.add_argument("--ttft-ms", type=float, default=1000.0)
    parser.add_argument("--itl-ms", type=float, default=50.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-blocks", type=int, default=None, help="per worker, as serve was given it")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--duration-s", type=float, default=None, help="stop after this long (default: never)")
    parser.add_argument("--json", dest="json_out", type=Path, default=None, help="the decisions, at the end")
    add_planner_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        profiles = {"agg": parse_profile(args.profile, "--profile"), "decode": parse_profile(args.profile, "--profile"),
                    "prefill": parse_profile(args.prefill_profile or args.profile, "--prefill-profile")}
        limits = limits_from(args)
        if args.ttft_ms <= 0 or args.itl_ms <= 0:
            raise ValueError("--ttft-ms and --itl-ms must be > 0")
        if args.planner_interval_s <= 0:
            raise ValueError("--planner-interval-s must be > 0")
        check_planner_flags(args)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    return asyncio.run(_run(args, profiles, limits))


async def _run(args: argparse.Namespace, profiles, limits) -> int:
    from tokenmill.planner.live import LiveDeployment

    headers = {"Authorization": f"Bearer {args.admin_api_key}"} if args.admin_api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=30.0, trust_env=False) as client:
        try:
            roles, connector = await _deployment(args, client)
        except (httpx.HTTPError, ValueError) as exc:
            where = "--connector kubernetes" if args.connector == "kubernetes" else f"--url {args.url}: /admin/workers"
            print(f"error: {where}: {exc}")
            return 2
        kv = None if args.kv_cache_blocks is None else {r: args.kv_cache_blocks * args.block_size for r in profiles}
        forecaster = make_forecaster(args.predictor, args.warm_start_trace, args.planner_interval_s)
        planner = make_planner(profiles, "decode" in roles, args.planner_mode, forecaster, limits,
                               args.ttft_ms / 1e3, args.itl_ms / 1e3, args.max_num_seqs, args.max_num_batched_tokens,
                               kv, (args.lookahead_s or 0.0) / args.planner_interval_s, args.forecast_quantile,
                               args.burst_quantile, hold=hold_from(args))
        deployment = LiveDeployment(planner, client, args.planner_interval_s, args.warmup_s, connector=connector,
                                    fast_s=args.fast_path_s)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        if args.duration_s:
            loop.call_later(args.duration_s, stop.set)
        printer = asyncio.create_task(_print_decisions(planner, stop))
        await deployment.run(stop)
        printer.cancel()
    if args.json_out:
        args.json_out.write_text(json.dumps([d.to_json() for d in planner.decisions], indent=1) + "\n")
    return 0


async def _deployment(args: argparse.Namespace, client: httpx.AsyncClient):
    """The roles the deployment runs, and the connector that lists and scales its workers (None:
    the frontend's /admin/workers does)."""
    if args.connector == "local":
        return {w.get("role") for w in await _workers(client)}, None
    from tokenmill.planner.kubernetes_connector import KubernetesConnector

    connector = KubernetesConnector.from_cluster(args.namespace, args.deployment_prefix, ("agg", "prefill", "decode"))
    roles = await connector.roles()
    if not roles:
        raise ValueError(f"no {args.deployment_prefix}-{{agg,prefill,decode}} Deployment in namespace {args.namespace}")
    connector.deployments = {role: name for role, name in connector.deployments.items() if role in roles}
    return roles, connector


async def _workers(client: httpx.AsyncClient) -> list[dict]:
    response = await client.get("/admin/workers")
    response.raise_for_status()
    return response.json().get("data", [])


async def _print_decisions(planner, stop: asyncio.Event) -> None:
    last = float("-inf")  # the deque keeps the newest decisions only: follow them by time
    while not stop.is_set():
        await asyncio.sleep(0.5)
        for decision in [d for d in planner.decisions if d.at_s > last]:
            print(f"[{decision.at_s:8.1f} s] {decision.reason}", flush=True)
            last = decision.at_s
