"""What `tokenmill serve` and `tokenmill frontend` share: the frontend's flags, its
backend (worker pool + router) and the HTTP server."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from tokenmill.api.auth import ApiKeys
from tokenmill.router.policies import POLICIES

log = logging.getLogger(__name__)


def add_frontend_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="model id in the API (default: the directory name)")
    parser.add_argument("--usd-per-worker-hour", type=float, default=0.0,
                        help="the price of a worker-hour, for tokenmill_cost_per_million_tokens (default with "
                             "--mock-profile: its GPUs at $3 per GPU-hour, times --mock-speedup)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="deadline of every request")
    parser.add_argument("--router", default=None, choices=POLICIES,
                        help="how requests are routed to workers (default: kv with several workers)")
    parser.add_argument("--router-temperature", type=float, default=0.0,
                        help="> 0 samples workers with softmax over normalised costs")
    parser.add_argument("--disagg-threshold", type=int, default=256,
                        help="with prefill workers: prompts with fewer uncached tokens are prefilled "
                             "on the decode worker (0: always remote)")
    parser.add_argument("--prefill-queue-limit", type=int, default=8,
                        help="with prefill workers: prefill locally while every prefill worker has "
                             "this many prefills in flight")
    parser.add_argument("--local-prefill-limit", type=int, default=1,
                        help="... and while the decode worker prefills fewer than this many prompts itself "
                             "(0: never; each local prefill stalls the decode worker's streams)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $TOKENMILL_API_KEY)")
    parser.add_argument("--admin-api-key", default=None,
                        help="the key /admin routes require (default: $TOKENMILL_ADMIN_API_KEY, else the API key)")
    parser.add_argument("--tenants", default=None, metavar="FILE",
                        help="a TOML file of tenants (keys, priority class, weight, quotas): /v1 then takes "
                             "their keys only, refuses a request over its tenant's quota with 429, and counts "
                             "each tenant's use (tokenmill_tenant_*, GET /admin/tenants)")
    parser.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                        help="generation requests this frontend lets into the fleet at once; the others wait, "
                             "released by their tenant's class, then its weighted share of tokens (default: no "
                             "limit)")
    parser.add_argument("--batch-share", type=float, default=0.8,
                        help="with --max-in-flight: the share of its slots batch-class requests may hold, the rest "
                             "kept for the other classes' arrivals")
    parser.add_argument("--queue-timeout-s", type=float, default=60.0,
                        help="with --max-in-flight: how long a request may wait for a slot before a 503; with "
                             "--scale-to-zero: for a worker to start")
    parser.add_argument("--scale-to-zero", action="store_true",
                        help="the pool may have no worker (a planner scaled it to zero): a request that finds "
                             "none waits for one to start (up to --queue-timeout-s) and /health stays 200 "
                             "(implied by serve --planner with --min-agg 0, or --min-decode 0 disaggregated)")
    parser.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                        help="the format the model writes tool calls in (default: read from its chat template)")
    parser.add_argument("--no-access-log", action="store_true",
                        help="no INFO line per generation request (id, route, status, tokens, TTFT, total)")
    parser.add_argument("--reuse-port", action="store_true",
                        help="bind with SO_REUSEPORT, so several frontends share --port (the kernel "
                             "spreads connections over them)")
    parser.add_argument("--events-stale-after-s", type=float, default=30.0,
                        help="a KV router whose events have been silent this long (across 10 decisions) raises "
                             "tokenmill_router_kv_events_stale and routes on its own past decisions until they return")
    parser.add_argument("--event-plane", default=None, metavar="nats://HOST:PORT[,HOST:PORT]",
                        help="KV events over NATS (every worker publishes, every frontend subscribes) "
                             "instead of each worker's ZeroMQ socket")
    parser.add_argument("--no-kv-snapshot-on-join", action="store_true",
                        help="a cold KV index: do not ask each worker for its cached blocks as it joins; a "
                             "worker's blocks then arrive with its first KV event (the event-id gap asks for "
                             "its snapshot), so routing starts blind to what was cached before")


def frontend_argv(args: argparse.Namespace) -> list[str]:
    """The frontend flags again, resolved, for one more API server of the same deployment
    (`tokenmill serve --api-servers N`): it shares the port, so it always reuses it."""
    return ["--host", args.host, "--port", str(args.port), "--served-model-name", model_name(args),
            "--usd-per-worker-hour", str(args.usd_per_worker_hour), "--request-timeout-s", str(args.request_timeout_s),
            "--router", router_policy(args), "--router-temperature", str(args.router_temperature),
            "--disagg-threshold", str(args.disagg_threshold), "--prefill-queue-limit", str(args.prefill_queue_limit),
            "--local-prefill-limit", str(args.local_prefill_limit),
            "--events-stale-after-s", str(args.events_stale_after_s),
            *(["--event-plane", args.event_plane] if args.event_plane else []),
            *(["--no-kv-snapshot-on-join"] if args.no_kv_snapshot_on_join else []),
            "--reuse-port", *(["--no-access-log"] if args.no_access_log else []),
            *(["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else []),
            *(["--tenants", str(Path(args.tenants).resolve())] if args.tenants else []),
            *(["--max-in-flight", str(args.max_in_flight)] if args.max_in_flight else []),
            "--queue-timeout-s", str(args.queue_timeout_s), "--batch-share", str(args.batch_share),
            *(["--scale-to-zero"] if scale_to_zero(args) else [])]


def scale_to_zero(args: argparse.Namespace) -> bool:
    """May the serving pool be empty: asked for, or a planner here whose minimum for it is 0."""
    if args.scale_to_zero:
        return True
    if getattr(args, "planner_mode", None) is None:
        return False
    return getattr(args, "min_decode" if getattr(args, "prefill", 0) else "min_agg", 1) == 0


def event_plane(args: argparse.Namespace, name: str):
    """`--event-plane nats://…`: the frontend's NATS connection (ValueError naming the flag)."""
    if not getattr(args, "event_plane", None):
        return None
    from tokenmill.runtime.event_plane import NatsEventPlane, parse_event_plane

    return NatsEventPlane(parse_event_plane(args.event_plane), name=name)


def router_policy(args: argparse.Namespace) -> str:
    if args.router is not None:
        return args.router
    # disaggregated: the decode pool's router also tells how much of a prompt a worker caches
    disaggregated = getattr(args, "prefill", 0) > 0
    return "kv" if disaggregated or getattr(args, "workers", 2) > 1 else "least-loaded"


def disagg_config(args: argparse.Namespace):
    from tokenmill.router.disagg import DisaggConfig

    return DisaggConfig(threshold_tokens=args.disagg_threshold, queue_limit=args.prefill_queue_limit,
                        local_limit=args.local_prefill_limit)


def model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or Path(args.model).resolve().name


def make_backend(args: argparse.Namespace, discovery):
    from tokenmill.fleet.distributed_backend import DistributedBackend
    from tokenmill.fleet.empty_pool import EmptyPoolWait
    from tokenmill.fleet.worker_pool import WorkerPool
    from tokenmill.router.cost import CostConfig
    from tokenmill.router.policies import Router, RouterConfig
    from tokenmill.textgen.model_config import load_model_config
    from tokenmill.textgen.tokenizer import Tokenizer

    config = load_model_config(args.model)
    limit = args.max_model_len or config.max_position_embeddings
    def router(policy: str) -> Router:
        return Router(RouterConfig(policy=policy, block_size=getattr(args, "block_size", 16),
                                   cost=CostConfig(temperature=args.router_temperature),
                                   events_stale_after_s=args.events_stale_after_s))

    # the prefill pool is always routed by KV overlap: that is where prompts are computed
    pool = WorkerPool(discovery, router(router_policy(args)), prefill_router=router("kv"),
                      event_plane=event_plane(args, "frontend"),
                      snapshot_on_join=not args.no_kv_snapshot_on_join)
    backend = DistributedBackend(pool, Tokenizer(args.model), model_name(args), limit,
                                 default_timeout_s=args.request_timeout_s, disagg=disagg_config(args))
    if scale_to_zero(args):
        backend.empty_pool = EmptyPoolWait(args.queue_timeout_s)
    return backend


async def run_http(args: argparse.Namespace, backend) -> None:
    import uvicorn

    from tokenmill.api.app import create_app

    app = create_app(backend, model_name(args), usd_per_worker_hour=args.usd_per_worker_hour or None,
                     request_timeout_s=args.request_timeout_s, keys=api_keys(args),
                     access_log=not args.no_access_log, tool_call_parser=args.tool_call_parser,
                     api_servers=getattr(args, "api_servers", 1), tenants=tenants_from(args),
                     queue=fleet_queue(args))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           http="httptools", access_log=False,
                                           timeout_graceful_shutdown=5))
    sockets = [shared_port_socket(args.host, args.port)] if args.reuse_port else None
    planner = _start_planner(app, args)
    log.info("serving %s on http://%s:%d", model_name(args), args.host, args.port)
    announce = asyncio.create_task(_announce_when_up(server, f"http://{args.host}:{args.port}"))
    exit_on_sigterm()  # uvicorn shuts down on SIGTERM, then raises it again with the handler it found: this one
    try:
        await server.serve(sockets=sockets)
    finally:
        announce.cancel()
        if planner is not None:
            await planner.close()


async def _announce_when_up(server: Any, url: str) -> None:
    """Say where the API and the dashboard are once the server listens (not before: a browser
    opened on the line finds them)."""
    while not server.started:
        await asyncio.sleep(0.1)
    log.info("ready: the API at %s/v1, the dashboard at %s/dashboard", url, url)


def _start_planner(app, args: argparse.Namespace):
    """`serve --planner MODE`: the planner in this process, its decisions at /admin/planner."""
    if getattr(args, "planner_mode", None) is None:
        return None
    from tokenmill.planner.in_process import start

    ctx = app.app.state.serving
    ctx.planner = start(app, args, ctx.metrics.registry, api_keys(args).admin)
    empty_pool = getattr(ctx.backend, "empty_pool", None)
    if empty_pool is not None:  # a request waiting on a pool scaled to zero wakes the planner at once
        empty_pool.listeners.append(ctx.planner.deployment.wake)
    return ctx.planner


def tenants_from(args: argparse.Namespace):
    """`--tenants FILE`'s tenants (None without it); ValueError naming the flag and the field."""
    if args.tenants is None:
        return None
    if ApiKeys.resolve(args.api_key, None).api is not None:
        raise ValueError("--api-key (or $TOKENMILL_API_KEY): with --tenants, /v1 takes the tenants' keys only; "
                         "give this key to a tenant (keys = [...]) or leave it out")
    from tokenmill.tenants.config import load_tenants

    return load_tenants(args.tenants)


def fleet_queue(args: argparse.Namespace):
    """`--max-in-flight`'s queue (None without it); ValueError naming the flag."""
    if not args.queue_timeout_s > 0:
        raise ValueError(f"--queue-timeout-s must be positive, got {args.queue_timeout_s}")
    if args.max_in_flight is None:
        return None
    if args.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be at least 1, got {args.max_in_flight}")
    from tokenmill.api.tenancy import FleetQueue

    return FleetQueue(args.max_in_flight, args.queue_timeout_s, args.batch_share)


def api_keys(args: argparse.Namespace) -> ApiKeys:
    return ApiKeys.resolve(args.api_key, args.admin_api_key)


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) that other processes may bind too (SO_REUSEPORT):
    the kernel then hands each new connection to one of them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def exit_on_sigterm() -> None:
    """From now on a SIGTERM raises SystemExit, which unwinds through the callers' clean-up
    (stopping the workers): the default handler would end the process before it runs."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_after_cleanup)


def _exit_after_cleanup(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


