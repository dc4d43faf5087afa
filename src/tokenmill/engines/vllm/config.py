"""A vLLM worker's engine options: tokenmill's engine flags mapped to vLLM's, then `--engine-arg`
pairs, then vLLM's own flags, parsed by vLLM's own CLI parser (so every option, its type and its
error message are vLLM's). Later flags win, so a user's option overrides a mapped one.

    tokenmill flag           vLLM option
    --model                  model (and tokenizer)
    --dtype auto             float32 on a CPU host without AMX (vLLM's CPU bf16 measured ~5x slower
                             than its fp32 there), else the checkpoint's dtype
    --block-size             block_size: must stay equal, the routers hash blocks of this size
    --max-model-len          max_model_len
    --kv-cache-blocks        num_gpu_blocks_override
    --kv-cache-gb            kv_cache_memory_bytes (on a CPU host when not given, the own engine's
                             default, $TOKENMILL_KV_CACHE_GB or 1 GiB, not vLLM's 92% of the host's memory)
    --no-prefix-caching      no_enable_prefix_caching
    --seed                   seed
    --threads                OMP_NUM_THREADS (vLLM's CPU worker then binds no cores itself)
The scheduling knobs (--max-num-seqs, --max-num-batched-tokens) are the own engine's; vLLM keeps
its defaults unless given as engine args.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tokenmill.engine.config import default_kv_cache_gb
from tokenmill.engine.cpu_features import cpu_flags
from tokenmill.engines.options import check_vllm_transfer_backends, parse_engine_args
from tokenmill.openmp_env import untune

log = logging.getLogger(__name__)

GIB = 1 << 30
CONNECTOR = "TokenmillConnector"  # engines/vllm/connector.py, vLLM loads it by module path


@dataclass(slots=True)
class EventEndpoints:
    """Where vLLM's engine core publishes KV events, and answers replays, for this worker."""
    publish: str
    replay: str
    topic: str = "kv"

    @classmethod
    def in_dir(cls, directory: Path) -> EventEndpoints:
        return cls(f"ipc://{directory}/kv-events.sock", f"ipc://{directory}/kv-replay.sock")


def engine_args_from(args: argparse.Namespace, endpoints: EventEndpoints):
    """vLLM's `AsyncEngineArgs` for this worker; ValueError naming the option for a bad one."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    parser = vllm_parser()
    argv = [*mapped_argv(args, endpoints), *engine_arg_argv(parser, args.engine_arg), *args.engine_flags]
    namespace = parser.parse_args(argv)
    engine_args = AsyncEngineArgs.from_cli_args(namespace)
    if engine_args.block_size != args.block_size:
        raise ValueError(f"--block-size {args.block_size}: vLLM was given block_size {engine_args.block_size}; the "
                         "routers hash blocks of --block-size tokens, so give the size there instead")
    if args.role != "agg":
        _compose_connectors(engine_args)
    check_block_size(args.block_size)
    _apply_environment(args)
    return engine_args


def _compose_connectors(engine_args) -> None:
    """A prefill or decode worker's transfer connector, and vLLM's own CPU offload beside it when
    `kv_offloading_size` is given: vLLM would otherwise replace the transfer connector with its
    offloading one, so both go into vLLM's MultiConnector (ours first: it does the loads)."""
    from vllm.config import KVTransferConfig

    ours = engine_args.kv_transfer_config
    if getattr(ours, "kv_connector", None) != CONNECTOR:
        raise ValueError("--engine-arg kv_transfer_config: a prefill or decode vLLM worker moves KV through "
                         f"tokenmill's {CONNECTOR}; leave vLLM's KV transfer config to --role")
    if engine_args.kv_offloading_size is None:
        return
    if engine_args.kv_offloading_backend != "native":
        raise ValueError(f"--engine-arg kv_offloading_backend={engine_args.kv_offloading_backend}: a prefill or "
                         "decode vLLM worker composes vLLM's native offload with its transfer connector only")
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": engine_args.kv_offloading_size * GIB}}
    mine = {"kv_connector": CONNECTOR, "kv_role": ours.kv_role, "kv_connector_module_path": ours.kv_connector_module_path,
            "kv_connector_extra_config": ours.kv_connector_extra_config}
    engine_args.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy=ours.kv_load_failure_policy,
        kv_connector_extra_config={"connectors": [mine, offload]})
    engine_args.kv_offloading_size = None


def vllm_parser() -> argparse.ArgumentParser:
    """vLLM's engine-options parser, raising ValueError instead of printing its (very long) usage."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm engine options", add_help=False))

    def refuse(message: str) -> None:
        raise ValueError(f"vLLM engine option: {message}")

    parser.error = refuse  # type: ignore[method-assign]
    return parser


def mapped_argv(args: argparse.Namespace, endpoints: EventEndpoints) -> list[str]:
    argv = ["--model", args.model, "--dtype", vllm_dtype(args.dtype), "--block-size", str(args.block_size),
            "--seed", str(args.seed),
            "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": endpoints.publish, "replay_endpoint": endpoints.replay,
                                              "topic": endpoints.topic}),
            # tokenmill's grammars (structured outputs, forced tool calls) are llguidance's
            "--structured-outputs-config", json.dumps({"backend": "guidance"})]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.kv_cache_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(args.kv_cache_blocks)]
    kv_gb = args.kv_cache_gb
    # Without a KV size vLLM's CPU backend reserves 92% of the host's memory, and refuses to start unless
    # that much is free: wrong for several workers (or anything else) on one host. So it gets the own
    # engine's default size.
    if kv_gb is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ and not _has_cuda():
        kv_gb = default_kv_cache_gb()
    if kv_gb is not None:
        argv += ["--kv-cache-memory-bytes", str(int(kv_gb * GIB))]
    if args.no_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if args.role != "agg":
        argv += ["--kv-transfer-config", json.dumps(connector_config(args))]
    return argv


def connector_config(args: argparse.Namespace) -> dict:
    """vLLM's KV transfer config for a prefill or decode worker: tokenmill's connector, a failed
    pull recomputed (vLLM's default would fail the request)."""
    check_vllm_transfer_backends(args.kv_transfer_backends)
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": "tokenmill.engines.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"worker_id": args.worker_id, "hold_timeout_s": args.kv_hold_timeout_s,
                                          "pull_timeout_s": args.kv_pull_timeout_s, "faults": args.transfer_faults,
                                          "tcp_host": args.kv_transfer_host, "advertise_host": args.advertise_host}}


def engine_arg_argv(parser: argparse.ArgumentParser, pairs: list[str]) -> list[str]:
    """`--engine-arg KEY=VALUE` as vLLM flags: a boolean option becomes --key / --no-key."""
    options = {opt: action for action in parser._actions for opt in action.option_strings}  # noqa: SLF001
    argv: list[str] = []
    for key, value in parse_engine_args(pairs):
        action = options.get(f"--{key}")
        if action is None:
            raise ValueError(f"--engine-arg {key}={value}: vLLM has no engine option --{key}")
        if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
            truth = value.strip().lower()
            if truth not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"--engine-arg {key}={value}: a boolean option takes true or false")
            argv.append(f"--{key}" if truth in ("true", "1", "yes") else f"--no-{key}")
            if truth not in ("true", "1", "yes") and f"--no-{key}" not in options:
                raise ValueError(f"--engine-arg {key}={value}: vLLM's --{key} cannot be turned off")
        else:
            argv += [f"--{key}", value]
    return argv


def vllm_dtype(dtype: str) -> str:
    """tokenmill's `--dtype auto` on a CPU host without AMX is float32: vLLM-CPU's bf16 measured ~5x
    slower than its fp32 on an AVX2-only EPYC (10.5 against 50-56 output tok/s on SmolLM2-135M);
    otherwise the flag as given (the checkpoint's dtype for auto)."""
    if dtype != "auto" or _has_cuda() or _has_amx():
        return dtype
    log.info("--dtype auto: float32 (vLLM's CPU bf16 is slower than its fp32 without AMX)")
    return "float32"


def check_block_size(block_size: int) -> None:
    """vLLM checks its attention kernel's block sizes only once the engine core starts, and then says
    so in its log alone: refuse here, naming the flag. Other platforms are vLLM's to check."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return
    sizes = CPUAttentionBackend.get_supported_kernel_block_sizes()
    if not any(block_size == s if isinstance(s, int) else block_size % s.base == 0 for s in sizes):
        raise ValueError(f"--block-size {block_size}: vLLM's CPU attention takes blocks of {sizes}; use "
                         f"--block-size 32 on the workers and the frontend")


def _apply_environment(args: argparse.Namespace) -> None:
    """vLLM's CPU worker reads these from the environment (a user's own setting wins); the OpenMP
    tuning of tokenmill's own engine does not reach vLLM's processes."""
    untune(os.environ)
    if args.threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    # "auto" binds every core but one to this worker: wrong for several workers sharing a host
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and not _has_cuda():
        # Unbound and without OMP_NUM_THREADS, vLLM's CPU worker drops torch to one thread for serving
        # (its rule for a GPU worker's host code); it gets the own engine's default, torch's.
        os.environ.setdefault("OMP_NUM_THREADS", str(_torch_threads()))
        # vLLM's CPU platform otherwise runs a one-process model in a third process (its multiprocess
        # executor) beside the engine core's, which AsyncLLM keeps either way. Without it a worker
        # imports vLLM twice, not three times: on a 2-core host it starts in 16 s, not 30, on 16 s less
        # CPU, with the same token ids. A user's core binding keeps that executor: it is what pins
        # the threads of the process it starts. (vLLM then warns that its seed may reach this
        # process's random state; this version seeds in the engine core only.)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _has_amx() -> bool:
    return "amx_bf16" in cpu_flags()
