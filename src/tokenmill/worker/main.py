"""`tokenmill worker`: run one worker process (engine + request socket + heartbeats)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Callable

from tokenmill.engines import VLLM
from tokenmill.runtime import event_loop

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.engine.cli_args import add_engine_arguments
    from tokenmill.engines.options import add_engine_selection

    add_engine_arguments(parser)
    add_engine_selection(parser)
    parser.add_argument("--worker-id", default="worker-0")
    parser.add_argument("--address", default="tcp://127.0.0.1:0",
                        help="where to listen: ipc:///path or tcp://host:port (port 0 picks one)")
    parser.add_argument("--discovery", default="file:.tokenmill/registry",
                        help="file:DIR (a registry directory shared with the frontend on this host) or "
                             "etcd://host:port[,host:port][/prefix] (workers on many hosts)")
    parser.add_argument("--discovery-ttl-s", type=float, default=3.0,
                        help="etcd: the registration's lease; a worker silent this long is gone")
    parser.add_argument("--advertise-host", default=None,
                        help="the host name or IP other hosts reach this worker at: registered in place of the "
                             "bound host of --address and --events-address (tcp://0.0.0.0:0, say), and "
                             "advertised for tcp KV transfers")
    parser.add_argument("--health-port", type=int, default=None,
                        help="answer GET /health here (200 while taking requests, else 503): a readiness probe")
    parser.add_argument("--health-host", default="127.0.0.1",
                        help="where --health-port listens (0.0.0.0 in a pod, for the kubelet)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-queue", type=int, default=None,
                        help="requests that may wait beyond a full batch before 'overloaded'")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process exits")
    parser.add_argument("--event-plane", default=None, metavar="nats://HOST:PORT[,HOST:PORT]",
                        help="publish KV events on NATS (subject tokenmill.kv.<model>.<worker>) instead of "
                             "a ZeroMQ socket (--events-address)")
    parser.add_argument("--events-address", default=None,
                        help="publish KV events here (ipc:// or tcp://host:0); default: not published")
    parser.add_argument("--role", default="agg", choices=("agg", "prefill", "decode"),
                        help="agg: prefill and decode; prefill/decode: disaggregated, with KV transfer")
    parser.add_argument("--kv-transfer-backends", default="shm,tcp",
                        help="KV transfer backends in order of preference (shm: same host, tcp: any)")
    parser.add_argument("--kv-transfer-host", default="127.0.0.1",
                        help="tcp KV transfers: address to listen on and advertise to peers (this host's IP "
                             "across hosts)")
    parser.add_argument("--kv-hold-timeout-s", type=float, default=30.0,
                        help="prefill: free a handed-off prompt's KV if no decode worker acknowledges in time")
    parser.add_argument("--kv-pull-timeout-s", type=float, default=10.0,
                        help="decode: give up a KV pull after this long and recompute the prompt")
    parser.add_argument("--transfer-faults", default=None,
                        help="inject KV-pull faults for drills: corrupt[=N],drop[=N],delay=SECONDS (=N: every N-th pull)")
    parser.add_argument("--drain-timeout-s", type=float, default=10.0,
                        help="on SIGTERM: how long prefill requests and held KV may finish")
    parser.add_argument("--check-only", action="store_true",
                        help="check the flags (and the engine's options) and exit: 0 if accepted, 2 if not")
    parser.add_argument("--report-accepted-options", action="store_true",
                        help="write a line on stderr once the engine has taken its options (before it starts): "
                             "serve starts its other workers then")


def run(args: argparse.Namespace) -> int:
    from tokenmill.engines.adapter import EngineStartError
    from tokenmill.engines.options import OPTIONS_ACCEPTED, check_engine_selection, default_block_size
    from tokenmill.runtime.discovery import discovery_from_url
    from tokenmill.worker.server import WorkerServer
    from tokenmill.worker.settings import WorkerSettings

    name = args.served_model_name or args.model
    args.block_size = args.block_size or default_block_size(args.engine)
    try:
        check_engine_selection(args)
        _check_transfer_flags(args)
        settings = WorkerSettings(args.worker_id, args.address, name, role=args.role, max_queue=args.max_queue,
                                  parent_pid=args.parent_pid, events_address=args.events_address,
                                  drain_timeout_s=args.drain_timeout_s, advertise_host=args.advertise_host)
        if args.check_only:
            return _check_only(args)
        discovery = discovery_from_url(args.discovery, args.discovery_ttl_s)
        event_plane = _event_plane(args)
        engine, transfer = _vllm_engine(args) if args.engine == VLLM else _own_engine(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.report_accepted_options:
        sys.stderr.write(OPTIONS_ACCEPTED + "\n")  # one write: no other thread's line inside it
        sys.stderr.flush()
    server = WorkerServer(engine, settings, discovery, transfer, event_plane)
    address = server.bind()
    health = None
    if args.health_port is not None:
        from tokenmill.worker.health import HealthServer

        try:
            health = HealthServer(args.health_host, args.health_port, server.ready)
        except OSError as exc:
            print(f"error: --health-port {args.health_port}: {exc}", file=sys.stderr)
            return 2
        health.start()
    log.info("worker %s serving %s on %s", args.worker_id, name, address)
    try:
        event_loop.run(_serve(server))
    except EngineStartError as exc:  # not registered, so never counted as up; the supervisor retries
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if health is not None:
            health.close()
    return 0


def _check_only(args: argparse.Namespace) -> int:
    """--check-only: the engine's options as it would take them, nothing started."""
    if args.engine == VLLM:
        _vllm_engine(args)[0].discard()
    else:
        from tokenmill.engine.cli_args import engine_config_from_args

        engine_config_from_args(args, args.worker_id)
    print(f"ok: the {args.engine} engine's options are accepted")
    return 0


def _own_engine(args: argparse.Namespace):
    """tokenmill's engine, and its KV transfer agent where the role moves KV."""
    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.engine.cli_args import engine_config_from_args
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.worker.mock_profile import resolve_mock_profile, transfer_delay

    config, clock = resolve_mock_profile(engine_config_from_args(args, args.worker_id), args.mock_profile)
    config = dataclasses.replace(config, exit_on_rank_loss=True)
    transfer = _transfer_service(args, transfer_delay(clock, config.mock_speedup))
    return AsyncLLMEngine(LLMEngine(config, kv_allocator=transfer.allocate if transfer else None)), transfer


def _vllm_engine(args: argparse.Namespace):
    try:
        from tokenmill.engines.vllm.adapter import VLLMEngine
    except ImportError as exc:
        from tokenmill.engines.options import INSTALL_HINT

        raise ValueError(f"--engine vllm: vLLM is not importable by {sys.executable} ({exc}); install its venv "
                         f"with {INSTALL_HINT}") from exc
    engine = VLLMEngine.from_args(args, args.worker_id)
    if args.role == "agg":
        return engine, None
    from tokenmill.engines.vllm.handoff import VLLMHandoff

    return engine, VLLMHandoff(args.worker_id, args.kv_hold_timeout_s)


def _event_plane(args: argparse.Namespace):
    if args.event_plane is None:
        return None
    if args.events_address is not None:
        raise ValueError("--event-plane and --events-address: KV events go on one plane, choose one")
    from tokenmill.runtime.event_plane import NatsEventPlane, parse_event_plane

    return NatsEventPlane(parse_event_plane(args.event_plane), name=args.worker_id)


def _check_transfer_flags(args: argparse.Namespace) -> None:
    """Before any engine starts (a vLLM worker's connector reads them in vLLM's processes)."""
    from tokenmill.worker.transfer_faults import TransferFaults

    for flag in ("kv_hold_timeout_s", "kv_pull_timeout_s"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")
    TransferFaults.parse(args.transfer_faults)


def _transfer_service(args: argparse.Namespace, mock_transfer_seconds: Callable[[int], float] | None = None):
    """Prefill and decode workers move KV; an agg worker has no use for an agent.
    `mock_transfer_seconds`: a mock profile's link time for a pull of N tokens."""
    if args.role == "agg":
        return None
    from tokenmill.transfer import ShmBackend, TcpBackend  # torch: only workers that move KV load it
    from tokenmill.worker.kv_transfer import KVTransferService
    from tokenmill.worker.transfer_faults import TransferFaults

    names = [b.strip() for b in args.kv_transfer_backends.split(",") if b.strip()]
    unknown = set(names) - {"shm", "tcp"}
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"--kv-transfer-backends: choose from shm, tcp (got {args.kv_transfer_backends!r})")
    backends = [ShmBackend() if name == "shm" else
                TcpBackend(args.kv_transfer_host, advertise_host=args.advertise_host) for name in names]
    return KVTransferService(args.worker_id, backends, args.kv_hold_timeout_s, args.kv_pull_timeout_s,
                             TransferFaults.parse(args.transfer_faults), mock_transfer_seconds)


async def _serve(server) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)
    loop.add_signal_handler(signal.SIGUSR1, server.drain)  # `tokenmill serve`: finish what it holds, then exit
    await server.serve()
