"""What `tokenmill bench engines` compares: the two servers of each comparison, how each starts and
stops, and the load each comparison sends.

- layer: `tokenmill serve --engine vllm` (frontend + one vLLM worker) against vLLM's own OpenAI
  server alone, on the same vLLM settings: what tokenmill's layer costs. `tokenmill serve` runs
  from this venv and its vLLM workers under `--engine-python`, as a user runs it.
- routing: `tokenmill serve --engine vllm --workers 2`, `--router kv` against `round-robin`, on
  `bench prefix-routing`'s shared-prefix load, each worker's KV pool a fraction of the prefixes.
- engines: `tokenmill serve` on its own engine against `tokenmill serve --engine vllm`, same threads.

The vLLM sides' threads are set through vLLM's CPU environment: one worker is pinned to cores
0..T-1 (`VLLM_CPU_OMP_THREADS_BIND`); two workers cannot each get their own cores from one shared
environment, so they run unpinned with T/2 threads each and the OS spreads them.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.engines.engines_report import Goal
from tokenmill.bench.harness.serve_process import (
    HOST,
    VLLM_SERVE_FLAGS,
    ServeProcess,
    free_port,
    launch,
    log_tail,
    running_server,
    stop,
    wait_ready,
)
from tokenmill.bench.harness.text_workload import build_workload, corpus_words
from tokenmill.workloads.prompt_synth import RequestSpec, SyntheticShape, corpus_requests

LAYER, ROUTING, ENGINES = "layer", "routing", "engines"
COMPARISONS = (LAYER, ROUTING, ENGINES)
SERVE, VLLM_ALONE = "tokenmill-serve", "vllm-serve"
VLLM_MODULE = "vllm.entrypoints.openai.api_server"  # its `vllm` console script is broken in the CPU build
SERVED_NAME = "engines-bench"
# vLLM's CPU attention takes only multiples of 32 ("No common block size for 16"); the vLLM workers get
# it through tokenmill's --block-size (their default), so the router hashes the blocks the engine caches
BLOCK_SIZE = 32
ROUTING_WORKERS = 2
ROUTING_MAX_TOKENS = 16  # prefix-routing's answer length: the comparison is about TTFT
WARMUP_PER_WORKER, WARMUP_TOKENS = 2, 8
WARMUP_SHAPE = SyntheticShape(64, 128, WARMUP_TOKENS, WARMUP_TOKENS)


@dataclass(slots=True, frozen=True)
class EnginesConfig:
    compare: tuple[str, ...]
    model: Path
    engine_python: Path
    requests: int
    repeats: int
    concurrency: int
    routing_concurrency: int
    shape: SyntheticShape  # layer and engines: prompt and answer lengths
    max_model_len: int
    model_context: int  # the checkpoint's max_position_embeddings
    threads: int
    kvcache_gib: int
    prefix_words: int
    groups: int
    pool_fraction: float
    timeout_s: float
    start_timeout_s: float
    seed: int
    dtype: str = "float32"  # every side's


@dataclass(slots=True, frozen=True)
class Side:
    """One server setup; `flags` are `tokenmill serve`'s (kind SERVE) or vLLM's API server's."""
    name: str
    kind: str
    python: str
    flags: tuple[str, ...]
    workers: int = 1
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> str:
        head = ["tokenmill", "serve"] if self.kind == SERVE else [self.python, "-m", VLLM_MODULE]
        tail = ["--workers", str(self.workers)] if self.kind == SERVE else []
        return " ".join([*head, *self.flags, *tail])

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "python": self.python, "command": self.command(), "env": dict(self.env)}


@dataclass(slots=True)
class Comparison:
    name: str
    sides: tuple[Side, Side]
    goals: tuple[Goal, ...]
    specs: list[RequestSpec]
    warmup: list[RequestSpec]
    concurrency: int
    workload: dict[str, Any]


def _vllm_env(cfg: EnginesConfig, workers: int) -> dict[str, str]:
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.kvcache_gib)}
    if workers == 1:
        cores = "0" if cfg.threads == 1 else f"0-{cfg.threads - 1}"
        return {**env, "VLLM_CPU_OMP_THREADS_BIND": cores}
    return {**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(max(1, cfg.threads // workers))}


def _vllm_worker(cfg: EnginesConfig, name: str, max_model_len: int, workers: int = 1,
                 extra: Sequence[str] = ()) -> Side:
    """`tokenmill serve --engine vllm` from this venv, as a user runs it: the frontend here, the
    workers under the vLLM venv's python."""
    flags = (*VLLM_SERVE_FLAGS, "--engine-arg", f"dtype={cfg.dtype}", "--engine-python", str(cfg.engine_python),
             "--model", str(cfg.model), "--served-model-name", SERVED_NAME, "--max-model-len", str(max_model_len),
             "--block-size", str(BLOCK_SIZE), *extra)
    return Side(name, SERVE, sys.executable, flags, workers, _vllm_env(cfg, workers))


def _vllm_alone(cfg: EnginesConfig) -> Side:
    flags = ("--model", str(cfg.model), "--served-model-name", SERVED_NAME, "--dtype", cfg.dtype,
             "--enforce-eager", "--max-model-len", str(cfg.max_model_len), "--block-size", str(BLOCK_SIZE))
    return Side(VLLM_ALONE, VLLM_ALONE, str(cfg.engine_python), flags, 1, _vllm_env(cfg, 1))


def _own_engine(cfg: EnginesConfig) -> Side:
    flags = ("--model", str(cfg.model), "--served-model-name", SERVED_NAME, "--threads", str(cfg.threads),
             "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len),
             "--kv-cache-gb", str(cfg.kvcache_gib))
    return Side("own-engine", SERVE, sys.executable, flags)


def _describe_load(specs: Sequence[RequestSpec], concurrency: int, what: str) -> dict[str, Any]:
    prompts = [len(s.prompt) for s in specs]
    outputs = sorted({s.output_len for s in specs})
    return {"description": f"{len(specs)} requests of {what}, {min(prompts)}-{max(prompts)} prompt tokens, "
                           f"{'/'.join(map(str, outputs))} output tokens, concurrency {concurrency}",
            "requests": len(specs), "prompt_tokens_min": min(prompts), "prompt_tokens_max": max(prompts),
            "prompt_tokens_mean": sum(prompts) / len(prompts), "output_tokens": outputs,
            "concurrency": concurrency}


def prose_load(cfg: EnginesConfig, corpus: Sequence[int]) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """(measured, warm-up) for layer and engines: corpus slices sent as token ids. The warm-up is one
    full batch of the measured shape (`concurrency` prompts, WARMUP_TOKENS out each): a first run
    with only short warm-ups measured first-batch costs (the first measured TTFTs 10+ s late) on
    whichever side ran first."""
    specs = corpus_requests(corpus, cfg.requests + cfg.concurrency, cfg.shape, cfg.seed)
    return specs[cfg.concurrency:], [RequestSpec(s.prompt, WARMUP_TOKENS) for s in specs[:cfg.concurrency]]


def layer(cfg: EnginesConfig, corpus: Sequence[int]) -> Comparison:
    specs, warmup = prose_load(cfg, corpus)
    goals = (Goal("output_tok_s", SERVE, VLLM_ALONE, ">=", 0.95), Goal("ttft_ms_p50", SERVE, VLLM_ALONE, "<=", 1.1))
    return Comparison(LAYER, (_vllm_worker(cfg, SERVE, cfg.max_model_len), _vllm_alone(cfg)), goals, specs, warmup,
                      cfg.concurrency, _describe_load(specs, cfg.concurrency, "corpus prose"))


def engines(cfg: EnginesConfig, corpus: Sequence[int]) -> Comparison:
    specs, warmup = prose_load(cfg, corpus)
    sides = (_own_engine(cfg), _vllm_worker(cfg, "vllm-engine", cfg.max_model_len))
    return Comparison(ENGINES, sides, (), specs, warmup, cfg.concurrency,
                      _describe_load(specs, cfg.concurrency, "corpus prose"))


def routing(cfg: EnginesConfig, corpus: Sequence[int], tokenizer: Any) -> Comparison:
    """prefix-routing's load through two vLLM workers; the context is sized to the load, and each
    worker's pool to `pool_fraction` of the prefixes' blocks, but never below its share of the
    requests in flight (else it would measure vLLM's preemption, not routing)."""
    out = min(ROUTING_MAX_TOKENS, cfg.shape.max_output)
    shape = argparse.Namespace(seed=cfg.seed, groups=cfg.groups, requests=cfg.requests, max_tokens=out,
                               pool_fraction=cfg.pool_fraction)
    load = build_workload(corpus_words(), cfg.prefix_words, tokenizer, shape)
    warmup = corpus_requests(corpus, WARMUP_PER_WORKER * ROUTING_WORKERS, WARMUP_SHAPE, cfg.seed + 1)
    longest = max(len(s.prompt) + s.output_len for s in [*load.specs, *warmup])
    context = -(-(longest + 1) // BLOCK_SIZE) * BLOCK_SIZE
    if context > cfg.model_context:
        raise ValueError(f"--prefix-words {cfg.prefix_words}: prompts of {longest} tokens exceed the "
                         f"model's context ({cfg.model_context})")
    in_flight = -(-cfg.routing_concurrency // ROUTING_WORKERS)
    # not load.kv_cache_blocks: prefix-routing counts blocks of 16 tokens
    pool = round(cfg.pool_fraction * sum(-(-t // BLOCK_SIZE) for t in load.prefix_tokens))
    blocks = max(pool, in_flight * context // BLOCK_SIZE + 1)
    kv, rr = (_vllm_worker(cfg, p, context, ROUTING_WORKERS, ("--router", p, "--kv-cache-blocks", str(blocks)))
              for p in ("kv", "round-robin"))
    goals = (Goal("ttft_ms_mean", "round-robin", "kv", ">=", 1.5),
             Goal("ttft_ms_p99", "kv", "round-robin", "<=", 1.1))
    what = f"{cfg.groups} shared {cfg.prefix_words}-word prefixes"
    workload = {**_describe_load(load.specs, cfg.routing_concurrency, what), "prefix_tokens": load.prefix_tokens,
                "kv_cache_blocks_per_worker": blocks, "max_model_len": context}
    specs: list[RequestSpec] = list(load.specs)
    return Comparison(ROUTING, (kv, rr), goals, specs, warmup, cfg.routing_concurrency, workload)


def _vllm_ready(url: str) -> bool:
    """GET /health answers 200 and GET /v1/models lists the served name."""
    try:
        if httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code != 200:
            return False
        cards = httpx.get(url + "/v1/models", timeout=2.0, trust_env=False).json().get("data") or []
    except (httpx.HTTPError, ValueError):
        return False
    return any(card.get("id") == SERVED_NAME for card in cards)


def _root_causes(log_path: Path, count: int = 3) -> str:
    """vLLM's last distinct exception lines: its log ends in engine-core stack frames that bury them."""
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    causes = [line.strip() for line in lines if "Error: " in line or "Error(" in line]
    return "\n".join(list(dict.fromkeys(causes))[-count:])


@contextmanager
def running_vllm(side: Side, log_path: Path, start_timeout_s: float) -> Iterator[str]:
    """vLLM's API server on a free loopback port, ready; stopped (its process group) on exit."""
    port = free_port()
    argv = [side.python, "-m", VLLM_MODULE, *side.flags, "--host", HOST, "--port", str(port)]
    url = f"http://{HOST}:{port}"
    # no registry: `stop` then only signals the process group, which holds vLLM's engine core too
    server = ServeProcess(url, log_path.with_suffix(".run"), launch(argv, log_path, side.env), 0)
    try:
        try:
            wait_ready(server.process, lambda: _vllm_ready(url), "vLLM's API server", start_timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {_root_causes(log_path) or log_tail(log_path)}") from exc
        yield url
    finally:
        stop(server)


@contextmanager
def side_server(side: Side, work_dir: Path, tag: str, start_timeout_s: float) -> Iterator[str]:
    """The side's server, fresh and ready: its base URL."""
    log_path = work_dir / f"{tag}.log"
    if side.kind == VLLM_ALONE:
        with running_vllm(side, log_path, start_timeout_s) as url:
            yield url
        return
    with running_server(side.flags, side.workers, work_dir / f"run-{tag}", log_path, start_timeout_s,
                        side.env) as server:
        yield server.url
