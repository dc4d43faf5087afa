"""Engine knobs as command-line flags, shared by every command that starts an engine.

`--mock-profile` is only carried here as text: the engine imports no simulator, so the worker
(`worker/mock_profile.py`) turns it into a clock and a KV pool size.
"""
from __future__ import annotations

import argparse
import math

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.mock_runner import StepTimeModel
from tokenmill.engine.speculative import SpeculativeConfig
from tokenmill.engines.options import VLLM_BLOCK_SIZE
from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, help="checkpoint directory (HF format)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    g.add_argument("--kv-cache-blocks", type=int, default=None, help="device KV pool size in blocks")
    g.add_argument("--kv-cache-gb", type=float, default=None,
                   help="device KV pool size in GiB (default: $TOKENMILL_KV_CACHE_GB, else 1; with "
                        "--mock-profile, the profile's capacity)")
    g.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE}; {VLLM_BLOCK_SIZE} with --engine vllm, "
                        "which vLLM's CPU attention needs); the frontend's must be the same")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--runner", default="torch", choices=["torch", "mock"])
    g.add_argument("--mock-step-time", default=None, metavar="A,B,C,D",
                   help="mock runner seconds = A + B*prefill_tokens + C*decode_seqs + D*kv_tokens_read")
    g.add_argument("--mock-profile", default=None, metavar="MODEL@GPU[:precision][:layout]",
                   help="mock runner: every step lasts what the simulator's step-time model predicts for "
                        "that model on that GPU (e.g. llama-3.1-8b@h100:fp8:tp1), KV transfers take the "
                        "GPU's link time, and the KV pool defaults to the profile's capacity; "
                        "not with --mock-step-time")
    g.add_argument("--mock-speedup", type=float, default=None, metavar="K",
                   help="mock runner: run K times faster than modelled time (waits seconds/K; default 1)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes) per worker")
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks per worker (MoE; with --tp, the same ranks)")
    g.add_argument("--attention-dp", type=int, default=1,
                   help="with --ep N: N attention data-parallel ranks, each scheduling its own requests on "
                        "its own KV pool while the experts stay split (the wide-EP layout)")
    _add_kernel_arguments(g)
    g.add_argument("--speculative", default=None, metavar="ngram|draft:DIR",
                   help="speculative decoding: 'ngram' drafts the tokens that followed the latest earlier "
                        "occurrence of the sequence's last 1-3 tokens (prompt lookup; no extra model); "
                        "'draft:DIR' drafts greedily with the small model in DIR (the same tokenizer). Each "
                        "decode step verifies the drafts in one forward pass (torch runner)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="drafts per request per step with --speculative (default 4)")
    add_tier_arguments(parser)


def _add_kernel_arguments(g: argparse._ArgumentGroup) -> None:
    """Where the forward pass runs, and how."""
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                   help="where the torch runner computes: cpu (the native kernels), cuda (PyTorch's ops on the "
                        "GPU), auto (cuda when torch sees one)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, launch every decode step op by op instead of replaying CUDA graphs of it")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels (CPU): a request's logits, and so its seeded tokens, are the same "
                        "bits whatever else shares its steps, whether its prefix was cached, recomputed or "
                        "pulled from another worker, and at any --max-num-batched-tokens")


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV tiers (below the device pool; torch runner only)")
    g.add_argument("--kv-host-gb", type=float, default=None, help="host-memory KV tier size in GiB")
    g.add_argument("--kv-disk-dir", default=None, help="local-disk KV tier directory")
    g.add_argument("--kv-disk-gb", type=float, default=None, help="disk tier size in GiB (default 4)")
    g.add_argument("--kv-shared", default=None, help="shared KV tier: redis://host:port/db or a shared directory")
    g.add_argument("--kv-shared-gb", type=float, default=None, help="shared tier size in GiB (default 1)")
    g.add_argument("--kv-write-through", action="store_true", help="write every offloaded block to the shared tier")
    g.add_argument("--kv-pin-file", default=None,
                   help="prefixes to pin at start: JSON lines, each a prompt string or a list of token ids")


def engine_config_from_args(args: argparse.Namespace, worker_id: str = "worker-0") -> EngineConfig:
    """Raises ValueError naming the flag for bad values (a parallel layout against the model's
    config.json too). A `--mock-profile` is checked for form here and resolved by the worker
    (`worker.mock_profile.resolve_mock_profile`)."""
    _check_mock_flags(args)
    config = EngineConfig(
        model=args.model, dtype=args.dtype, threads=args.threads, block_size=args.block_size or DEFAULT_BLOCK_SIZE,
        num_kv_blocks=args.kv_cache_blocks, kv_cache_gb=args.kv_cache_gb, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, runner=args.runner,
        mock_step_time=parse_step_time(args.mock_step_time), mock_speedup=mock_speedup(args),
        seed=args.seed, tp=args.tp, ep=args.ep, attention_dp=args.attention_dp, worker_id=worker_id,
        kv_host_gb=args.kv_host_gb, kv_disk_dir=args.kv_disk_dir, kv_disk_gb=args.kv_disk_gb,
        kv_shared=args.kv_shared, kv_shared_gb=args.kv_shared_gb, kv_write_through=args.kv_write_through,
        kv_pin_file=args.kv_pin_file,
        speculative=SpeculativeConfig.parse(args.speculative, args.num_speculative_tokens), device=args.device,
        enforce_eager=args.enforce_eager, deterministic=args.deterministic,
    )
    if config.tp != 1 or config.ep != 1 or config.attention_dp != 1:
        from tokenmill.engine.parallel.shard import check_layout

        check_layout(config)
    return config


def mock_speedup(args: argparse.Namespace) -> float:
    return 1.0 if args.mock_speedup is None else args.mock_speedup


def _check_mock_flags(args: argparse.Namespace) -> None:
    """The mock flags that cannot go together, named as the user typed them."""
    profile, speedup = args.mock_profile, args.mock_speedup
    if profile is not None and args.mock_step_time is not None:
        raise ValueError("--mock-profile and --mock-step-time are mutually exclusive: a step lasts either "
                         "what the profile's model predicts or A + B*prefill + C*decode + D*kv")
    if profile is not None and args.runner != "mock":
        raise ValueError("--mock-profile needs --runner mock")
    if speedup is not None:
        if not (math.isfinite(speedup) and speedup > 0):
            raise ValueError(f"--mock-speedup must be a finite number > 0, got {speedup}")
        if args.runner != "mock":
            raise ValueError("--mock-speedup needs --runner mock")


def parse_step_time(text: str | None) -> StepTimeModel:
    if text is None:
        return StepTimeModel()
    try:
        a, b, c, d = (float(x) for x in text.split(","))
    except ValueError as exc:
        raise ValueError(f"--mock-step-time must be four numbers A,B,C,D, got {text!r}") from exc
    return StepTimeModel(a, b, c, d)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The same knobs as flags again, to pass through to worker processes."""
    argv = ["--model", args.model, "--dtype", args.dtype, "--block-size", str(args.block_size or DEFAULT_BLOCK_SIZE),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--runner", args.runner, "--seed", str(args.seed), "--tp", str(args.tp), "--ep", str(args.ep),
            "--attention-dp", str(args.attention_dp), "--device", args.device]
    optional = {"--threads": args.threads, "--kv-cache-blocks": args.kv_cache_blocks,
                "--kv-cache-gb": args.kv_cache_gb, "--max-model-len": args.max_model_len,
                "--mock-step-time": args.mock_step_time, "--mock-profile": args.mock_profile,
                "--mock-speedup": args.mock_speedup, "--kv-host-gb": args.kv_host_gb,
                "--kv-disk-dir": args.kv_disk_dir, "--kv-disk-gb": args.kv_disk_gb, "--kv-shared": args.kv_shared,
                "--kv-shared-gb": args.kv_shared_gb, "--kv-pin-file": args.kv_pin_file,
                "--speculative": args.speculative, "--num-speculative-tokens": args.num_speculative_tokens}
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    if args.kv_write_through:
        argv.append("--kv-write-through")
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if args.deterministic:
        argv.append("--deterministic")
    return argv
