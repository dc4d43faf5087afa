"""`tokenmill serve`: one HTTP frontend and supervised worker processes on this host:
`--workers N` aggregated workers, or `--prefill P --decode D` disaggregated ones; more of
either role are started, drained and re-roled at runtime through `/admin/workers`
(`worker_control.py`), with the same engine flags."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.api.auth import ADMIN_API_KEY_ENV, API_KEY_ENV
from tokenmill.api.launch import (
    add_frontend_flags,
    api_keys,
    disagg_config,
    event_plane,
    exit_on_sigterm,
    fleet_queue,
    frontend_argv,
    make_backend,
    model_name,
    router_policy,
    run_http,
    tenants_from,
)
from tokenmill.engines import VLLM
from tokenmill.engines.options import check_vllm_transfer_backends
from tokenmill.fleet.control_socket import CONTROL_SOCKET_ENV
from tokenmill.router.policies import RouterConfig
from tokenmill.runtime import event_loop
from tokenmill.runtime.scratch import remove_scratch_of
from tokenmill.runtime.unix_sockets import socket_dir
from tokenmill.transfer.memory import remove_shared_files_of

if TYPE_CHECKING:
    from tokenmill.fleet.worker_processes import WorkerSupervisor
    from tokenmill.runtime.supervisor import ChildSpec

log = logging.getLogger(__name__)

CONTROL_SOCKET = "control.sock"  # beside the workers' sockets: the other API servers' way to the workers
CHECK_TIMEOUT_S = 120  # for the first vLLM worker to take the engine options (it imports vLLM: seconds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.engine.cli_args import add_engine_arguments
    from tokenmill.engines.options import add_engine_selection

    add_engine_arguments(parser)
    add_engine_selection(parser, with_python=True)
    parser.add_argument("--workers", type=int, default=1, help="aggregated worker processes")
    parser.add_argument("--prefill", type=int, default=0,
                        help="disaggregated: prefill worker processes (with --decode; replaces --workers)")
    parser.add_argument("--decode", type=int, default=0, help="disaggregated: decode worker processes")
    parser.add_argument("--kv-transfer-backends", default="shm,tcp",
                        help="disaggregated: KV transfer backends in order of preference")
    parser.add_argument("--transfer-faults", default=None,
                        help="disaggregated drills: inject KV-pull faults on decode workers (corrupt[=N],drop[=N],delay=S; =N: every N-th pull)")
    add_frontend_flags(parser)
    parser.add_argument("--api-servers", type=int, default=1,
                        help="HTTP frontend processes sharing --port (SO_REUSEPORT), each with its own router "
                             "fed by the same KV events; more than one helps only with cores to spare")
    parser.add_argument("--max-queue", type=int, default=None,
                        help="requests a worker may hold waiting beyond a full batch before 429")
    parser.add_argument("--run-dir", default=None,
                        help="directory for the registry and the worker sockets (default: a fresh temp dir); "
                             "sockets go to a short temp dir if its path is too long for one")
    parser.add_argument("--worker-start-timeout-s", type=float, default=300.0,
                        help="a worker started through /admin/workers that has not registered by then has failed")
    from tokenmill.planner.flags import add_serve_planner_arguments

    add_serve_planner_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from tokenmill.engine.cli_args import engine_argv, engine_config_from_args
    from tokenmill.engines.options import check_engine_selection, default_block_size
    from tokenmill.worker.mock_profile import resolve_mock_profile

    args.block_size = args.block_size or default_block_size(args.engine)
    try:
        check_engine_selection(args)
        # flag errors here, once, not in N workers; the profile is resolved as each worker will
        config, clock = resolve_mock_profile(engine_config_from_args(args), args.mock_profile)
        if clock is not None and not args.usd_per_worker_hour:
            args.usd_per_worker_hour = profile_worker_hour(clock.profile.gpus, config.mock_speedup)
        _check_topology(args)
        disagg_config(args)
        event_plane(args, "check")  # a bad --event-plane names itself here, before any worker starts
        tenants_from(args)
        fleet_queue(args)
        RouterConfig(policy=router_policy(args), events_stale_after_s=args.events_stale_after_s)
        if args.planner_mode is not None:  # (the planner's modules load the simulator: only when asked)
            from tokenmill.planner.in_process import check_flags

            check_flags(args)
        args.worker_python = _worker_python(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="tokenmill-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    sockets = socket_dir(run_dir)
    try:
        return event_loop.run(_serve(args, run_dir, sockets, engine_argv(args)))
    except KeyboardInterrupt:
        return 0
    finally:
        if sockets != run_dir:
            shutil.rmtree(sockets, ignore_errors=True)
        if not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


async def _serve(args: argparse.Namespace, run_dir: Path, sockets: Path, engine_args: list[str]) -> int:
    """The workers and API servers of one run: the registry in `run_dir`, the Unix sockets in `sockets`."""
    from tokenmill.api.routes_admin import answer_workers
    from tokenmill.fleet.control_socket import serve_control_socket
    from tokenmill.fleet.worker_control import WorkerControl
    from tokenmill.fleet.worker_processes import WorkerSupervisor
    from tokenmill.runtime.discovery import FileDiscovery
    from tokenmill.runtime.supervisor import ChildSpec

    registry = run_dir / "registry"
    discovery = FileDiscovery(registry)

    def worker_spec(name: str, role: str, report_options: bool = False) -> ChildSpec:
        return ChildSpec(name, _worker_argv(args, name, role, run_dir, sockets, engine_args, report_options))

    specs = [worker_spec(name, role) for name, role in _workers(args)]
    keys = api_keys(args)  # to the other API servers by environment: a command line is public (ps)
    key_env = {k: v for k, v in ((API_KEY_ENV, keys.api), (ADMIN_API_KEY_ENV, keys.admin)) if v}
    key_env[CONTROL_SOCKET_ENV] = str(sockets / CONTROL_SOCKET)  # they forward /admin/workers here
    specs += [ChildSpec(f"api-server-{i}", _api_server_argv(args, run_dir), key_env)
              for i in range(1, args.api_servers)]
    args.reuse_port = args.reuse_port or args.api_servers > 1
    # the workers start first, all at once (vLLM's first alone, until it has taken the engine options):
    # they boot while this process loads the frontend
    supervisor = WorkerSupervisor(specs, on_exit=lambda name: _worker_died(backend, discovery, name,
                                                                          supervisor.pid(name)))
    exit_on_sigterm()  # from here a SIGTERM, even while the workers boot, unwinds through the clean-up below
    watchers: list[asyncio.Task] = []
    control_socket = None
    try:
        if args.engine == VLLM and (refusal := await _first_worker_takes_options(args, supervisor, worker_spec)):
            print(f"error: {refusal}", file=sys.stderr)
            return 2
        supervisor.start()
        backend = make_backend(args, discovery)
        roles = ("prefill", "decode") if args.prefill else ("agg",)
        backend.worker_control = control = WorkerControl(supervisor, backend.pool, worker_spec, roles,
                                                         _workers(args), args.worker_start_timeout_s)
        control.may_be_empty = backend.empty_pool is not None
        watchers = [asyncio.create_task(supervisor.watch()), asyncio.create_task(control.run())]
        if args.api_servers > 1:
            control_socket = await serve_control_socket(sockets / CONTROL_SOCKET, partial(answer_workers, control))
        await run_http(args, backend)
    finally:
        for watcher in watchers:
            watcher.cancel()
        if control_socket is not None:
            control_socket.close()
        supervisor.stop()
        for name in list(supervisor.children):
            _remove_files_of(supervisor.pid(name))  # of workers that had to be killed (or a refused one)
    return 0


def profile_worker_hour(gpus: int, speedup: float) -> float:
    """What a mock worker's wall-clock hour costs: its profile's GPUs at the simulator's GPU-hour
    price, for the `speedup` hours of GPU time it stands for."""
    from tokenmill.sim.pareto import DEFAULT_USD_PER_GPU_HOUR

    return gpus * DEFAULT_USD_PER_GPU_HOUR * speedup


def _worker_python(args: argparse.Namespace) -> str:
    """This interpreter for own-engine workers; for vLLM workers, the engine venv's (whose first
    worker checks the engine options, `_first_worker_takes_options`)."""
    if args.engine != VLLM:
        return sys.executable
    from tokenmill.engines.options import engine_python

    return engine_python(args)


async def _first_worker_takes_options(args: argparse.Namespace, supervisor: WorkerSupervisor,
                                      worker_spec: Callable[..., ChildSpec]) -> str | None:
    """vLLM's options are vLLM's parser's to judge, in its venv: the first worker (a decode worker
    when disaggregated: its options are a prefill worker's and the faults) starts alone, and the
    others once its engine has taken them. None, or the refusal in one line."""
    from tokenmill.engines.options import OPTIONS_ACCEPTED
    from tokenmill.fleet.output_gate import OutputGate

    name, role = next((name, role) for name, role in _workers(args) if role in ("agg", "decode"))
    first_argv = worker_spec(name, role, report_options=True).argv
    lines = await supervisor.start_gated(worker_spec(name, role), first_argv, OutputGate(OPTIONS_ACCEPTED),
                                         CHECK_TIMEOUT_S)
    if lines is None:
        return None
    errors = [line for line in lines if line.startswith("error: ")]
    return (errors[-1].removeprefix("error: ") if errors else
            f"--engine vllm: {name} under {args.worker_python} stopped before taking the engine options:\n"
            + "\n".join(lines[-20:]))


def _check_topology(args: argparse.Namespace) -> None:
    if args.api_servers < 1:
        raise ValueError("--api-servers must be at least 1")
    if not args.worker_start_timeout_s > 0:
        raise ValueError("--worker-start-timeout-s must be positive")
    if args.api_servers > 1 and args.port == 0:
        raise ValueError("--api-servers > 1 needs a fixed --port: the servers share it")
    if args.prefill or args.decode:
        if args.engine == VLLM:
            check_vllm_transfer_backends(args.kv_transfer_backends)
        if args.tp > 1 or args.ep > 1 or args.attention_dp > 1:
            flag = "--tp" if args.tp > 1 else "--ep" if args.ep > 1 else "--attention-dp"
            raise ValueError(f"{flag}: disaggregated serving moves KV from one "
                             "process's cache; a parallel worker's KV is split between ranks (not yet supported)")
        if args.prefill < 1 or args.decode < 1:
            raise ValueError("--prefill and --decode go together, each at least 1")
        if args.workers != 1:
            raise ValueError("--workers is for aggregated serving; use --prefill and --decode instead")
    elif args.workers < 1:
        raise ValueError("--workers must be at least 1")


def _workers(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, role) of every worker process."""
    if not args.prefill:
        return [(f"worker-{i}", "agg") for i in range(args.workers)]
    return ([(f"prefill-{i}", "prefill") for i in range(args.prefill)]
            + [(f"decode-{i}", "decode") for i in range(args.decode)])


def _worker_argv(args: argparse.Namespace, name: str, role: str, run_dir: Path, sockets: Path,
                 engine_args: list[str], report_options: bool = False) -> list[str]:
    from tokenmill.engines.options import engine_flags_argv, engine_selection_argv

    argv = [args.worker_python, "-m", "tokenmill.cli", "--log-level", args.log_level, "worker", *engine_args,
            *engine_selection_argv(args),
            "--worker-id", name, "--address", f"ipc://{sockets}/{name}.sock",
            "--discovery", f"file:{run_dir / 'registry'}", "--parent-pid", str(os.getpid()),
            "--served-model-name", model_name(args)]
    if args.event_plane:
        argv += ["--event-plane", args.event_plane]
    elif router_policy(args) == "kv" or role == "prefill":  # only KV routers consume events
        argv += ["--events-address", f"ipc://{sockets}/{name}-events.sock"]
    if args.max_queue is not None:
        argv += ["--max-queue", str(args.max_queue)]
    if report_options:
        argv.append("--report-accepted-options")
    return argv + _transfer_argv(args, role) + engine_flags_argv(args)  # last: everything after its -- is vLLM's


def _transfer_argv(args: argparse.Namespace, role: str) -> list[str]:
    """A worker's role and the flags its KV transfers take (none for agg)."""
    if role == "agg":
        return []
    argv = ["--role", role, "--kv-transfer-backends", args.kv_transfer_backends]
    if role == "decode" and args.transfer_faults:
        argv += ["--transfer-faults", args.transfer_faults]
    return argv


def _api_server_argv(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """One more HTTP frontend: its own worker pool and router, on the shared port."""
    argv = [sys.executable, "-m", "tokenmill.cli", "--log-level", args.log_level, "frontend", "--model", args.model,
            "--discovery", f"file:{run_dir / 'registry'}", "--block-size", str(args.block_size),
            "--parent-pid", str(os.getpid()), *frontend_argv(args)]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    return argv


def _worker_died(backend, discovery, name: str, pid: int) -> None:
    if name.startswith("api-server-"):
        return  # not a worker: the supervisor restarts it, the kernel routes around it meanwhile
    discovery.unregister(name)
    backend.pool.drop(name, "process exited")
    _remove_files_of(pid)


def _remove_files_of(pid: int) -> None:
    """What a worker killed before it could clean up leaves: its KV pool's shared memory and its
    scratch directory (an outside engine's sockets)."""
    remove_shared_files_of(pid)
    remove_scratch_of(pid)


