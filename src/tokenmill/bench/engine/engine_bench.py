"""`tokenmill bench engine`: the embedded engine in-process against transformers' generate().

A seeded workload (prompt token ids drawn uniformly from the non-special vocabulary,
lengths uniform in [--min-prompt, --max-prompt], outputs uniform in [--min-output,
--max-output], greedy with ignore_eos so output lengths are exact, all arriving at once)
runs through `LLMEngine`, then through transformers (see `hf_baseline`). A large-copy
memory bandwidth measured in the same process turns the bytes a decode step must read
into a floor for its time. The JSON schema is documented in `tokenmill.bench.engine.report`.
"""
from __future__ import annotations

import argparse
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenmill.bench.engine.engine_profile import profile_engine, render_profile
from tokenmill.bench.engine.hf_baseline import run_hf_baseline
from tokenmill.bench.engine.report import (
    DecodeStepShape,
    EngineBenchReport,
    TokenmillResult,
    WorkloadSummary,
    decode_floor,
    render_table,
)
from tokenmill.bench.harness.report_file import write_json

log = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "bfloat16", "float16")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
BANDWIDTH_BYTES = 256 * 2**20
BANDWIDTH_REPEATS = 5
MATMUL_SIZE, MATMUL_REPEATS = 512, 10  # 3 MB of fp32 operands: in cache, so the rate is arithmetic


@dataclass(slots=True)
class EngineBenchConfig:
    model: str
    json_path: str | None = None
    num_requests: int = 64
    min_prompt: int = 32
    max_prompt: int = 1024
    min_output: int = 16
    max_output: int = 256
    seed: int = 0
    dtype: str = "bfloat16"
    threads: int = 1  # in all: a parallel engine's ranks share them
    tp: int = 1
    ep: int = 1
    attention_dp: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    hf_batch_size: int = 16
    skip_hf: bool = False
    hf_max_requests: int | None = None
    profile: bool = False
    kv_cache_gb: float | None = None  # the engine's KV pool (None: its default)

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model!r}: not a model directory (no config.json)")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        for name in ("num_requests", "min_prompt", "min_output", "threads", "tp", "ep", "attention_dp",
                     "max_num_seqs", "max_num_batched_tokens", "hf_batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for low, high in (("min_prompt", "max_prompt"), ("min_output", "max_output")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"--{high.replace('_', '-')} ({getattr(self, high)}) is below "
                                 f"--{low.replace('_', '-')} ({getattr(self, low)})")
        for name in ("hf_max_requests", "kv_cache_gb"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    def engine(self, deterministic: bool = False) -> Any:
        """The `LLMEngine` this run measures (imported here: torch only where an engine runs)."""
        from tokenmill.engine.config import EngineConfig
        from tokenmill.engine.llm_engine import LLMEngine

        return LLMEngine(EngineConfig(model=self.model, dtype=self.dtype, threads=self.threads,
                                      max_num_seqs=self.max_num_seqs, tp=self.tp, ep=self.ep,
                                      attention_dp=self.attention_dp,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      kv_cache_gb=self.kv_cache_gb, deterministic=deterministic))


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    def summary(self) -> WorkloadSummary:
        plens = [len(p) for p in self.prompts]
        olens = self.output_lens
        return WorkloadSummary(
            num_requests=len(plens), prompt_source="random non-special token ids (seeded)",
            arrival="all at t=0", prompt_tokens=sum(plens), prompt_len_min=min(plens),
            prompt_len_mean=sum(plens) / len(plens), prompt_len_max=max(plens),
            output_tokens=sum(olens), output_len_min=min(olens),
            output_len_mean=sum(olens) / len(olens), output_len_max=max(olens),
        )


def make_workload(cfg: EngineBenchConfig, vocab_size: int, special_ids: frozenset[int]) -> Workload:
    rng = random.Random(cfg.seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    prompts, outputs = [], []
    for _ in range(cfg.num_requests):
        prompts.append(rng.choices(allowed, k=rng.randint(cfg.min_prompt, cfg.max_prompt)))
        outputs.append(rng.randint(cfg.min_output, cfg.max_output))
    return Workload(prompts, outputs)


def warm_up(engine: Any, workload: Workload) -> None:
    """One short request, so that first-call costs stay out of the measured run."""
    from tokenmill.textgen.sampling import SamplingParams

    engine.generate([workload.prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))


def run_tokenmill(engine: Any, workload: Workload, warm: bool = False,
                  collective_clock: Callable[[], float] | None = None,
                  ) -> tuple[TokenmillResult, list[DecodeStepShape]]:
    """Run the workload to completion; figures cover only this run (after a warm-up, unless the
    caller has done it: `warm`). `collective_clock` (a parallel engine's seconds in collectives
    so far) is read around each step, for the decode steps' share in `decode_collective_s`."""
    from tokenmill.textgen.sampling import SamplingParams

    if not warm:
        warm_up(engine, workload)
    before = engine.stats()
    generated = [0] * len(workload.prompts)
    shapes: list[DecodeStepShape] = []
    t0 = time.perf_counter()
    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(f"bench-{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0.0,
                                                               ignore_eos=True))
    decode_only_steps = before.num_decode_only_steps
    decode_collective_s = 0.0
    while engine.has_unfinished():
        collective_before = collective_clock() if collective_clock else 0.0
        outputs = engine.step()
        now_decode_only = engine.stats().num_decode_only_steps
        indices = [int(o.request_id.removeprefix("bench-")) for o in outputs]
        if now_decode_only > decode_only_steps:
            decode_collective_s += collective_clock() - collective_before if collective_clock else 0.0
            # a decode step's context: the prompt plus every token generated before this step
            context = sum(len(workload.prompts[i]) + generated[i] for i in indices)
            shapes.append(DecodeStepShape(len(indices), context))
        decode_only_steps = now_decode_only
        for i, out in zip(indices, outputs):
            generated[i] += len(out.new_token_ids)
    wall = time.perf_counter() - t0
    return _tokenmill_result(before, engine.stats(), wall, sum(generated), decode_collective_s,
                             len(engine.pool.blocks)), shapes


def _tokenmill_result(before: Any, after: Any, wall: float, output_tokens: int,
                      decode_collective_s: float, kv_blocks: int) -> TokenmillResult:
    steps = after.num_steps - before.num_steps
    decode_steps = after.num_decode_only_steps - before.num_decode_only_steps
    decode_s = after.decode_step_seconds - before.decode_step_seconds
    step_s = decode_s + after.prefill_step_seconds - before.prefill_step_seconds
    return TokenmillResult(
        output_tokens_per_s=output_tokens / wall, wall_s=wall,
        mean_step_ms=step_s / max(steps, 1) * 1e3,
        mean_decode_step_ms=decode_s / max(decode_steps, 1) * 1e3,
        mean_wall_step_ms=wall / max(steps, 1) * 1e3, steps=steps, decode_only_steps=decode_steps,
        preemptions=after.num_preemptions - before.num_preemptions, output_tokens=output_tokens,
        prefill_tokens=after.prefill_tokens - before.prefill_tokens, decode_s=decode_s,
        decode_collective_s=decode_collective_s, kv_blocks=kv_blocks,
    )


def measure_bandwidth_gbps(threads: int) -> float:
    """Best of a few copies of a 256 MiB tensor; a copy reads and writes every byte."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(BANDWIDTH_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the destination pages in before timing
    best = float("inf")
    for _ in range(BANDWIDTH_REPEATS):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * BANDWIDTH_BYTES / best / 1e9


def measure_matmul_gflops(threads: int, dtype: str) -> float:
    """The best in-cache matmul rate here: fp32, or the model's bf16 where torch computes it
    natively faster (the native kernels widen bf16 to fp32)."""
    import torch

    from tokenmill.sim.local_calibrate import measure_matmul_flops

    torch.set_num_threads(threads)
    best = measure_matmul_flops("fp32", MATMUL_SIZE, MATMUL_REPEATS)
    if dtype == "bfloat16":
        best = max(best, measure_matmul_flops("bf16", MATMUL_SIZE, 2))
    return best / 1e9


def run_engine_bench(cfg: EngineBenchConfig) -> EngineBenchReport:
    from tokenmill.engine.parallel.ranks import ParallelRunner

    engine = cfg.engine()
    _check_fits(cfg, engine.max_model_len)
    special = engine.tokenizer.special_token_ids if engine.tokenizer else frozenset()
    workload = make_workload(cfg, engine.model_config.vocab_size, special)
    log.info("tokenmill: %d requests, %d prompt and %d output tokens", cfg.num_requests,
             sum(map(len, workload.prompts)), sum(workload.output_lens))
    warm_up(engine, workload)
    group = engine.runner.ranks.group if isinstance(engine.runner, ParallelRunner) else None
    collective_before = group.collective_seconds if group is not None else 0.0
    clock = (lambda: group.collective_seconds) if group is not None else None
    tokenmill, shapes = run_tokenmill(engine, workload, warm=True, collective_clock=clock)
    parallel = None
    if group is not None:
        spent = group.collective_seconds - collective_before
        decode_share = tokenmill.decode_collective_s / tokenmill.decode_s if tokenmill.decode_s else 0.0
        parallel = {"tp": cfg.tp, "ep": cfg.ep, "attention_dp": cfg.attention_dp, "collective_s": spent,
                    "collective_share": spent / tokenmill.wall_s, "decode_collective_share": decode_share}
    profile = profile_engine(engine, workload.prompts, workload.output_lens) if cfg.profile else None
    model_cfg = engine.model_config
    engine.close()  # a parallel engine's ranks stop here
    del engine  # free its weights and KV cache before transformers loads its copy
    bandwidth = measure_bandwidth_gbps(cfg.threads)
    matmul = measure_matmul_gflops(cfg.threads, cfg.dtype)
    floor = decode_floor(model_cfg, ITEMSIZE[cfg.dtype], shapes, bandwidth, matmul, tokenmill.mean_decode_step_ms)
    predicted = _predicted_step(cfg, floor)
    hf = None
    if not cfg.skip_hf:
        log.info("transformers: batches of %d", cfg.hf_batch_size)
        hf = run_hf_baseline(cfg.model, cfg.dtype, workload.prompts, workload.output_lens,
                             cfg.hf_batch_size, cfg.hf_max_requests)
    ratio = tokenmill.output_tokens_per_s / hf.useful_output_tokens_per_s if hf else None
    return EngineBenchReport(asdict(cfg), workload.summary(), tokenmill, hf, ratio, floor, profile, parallel,
                             predicted)


def _predicted_step(cfg: EngineBenchConfig, floor: Any) -> dict[str, Any] | None:
    """The simulator's decode step for this layout at the run's mean decode shape (`cpu-local`)."""
    from tokenmill.sim.engine_fit import predict_engine_decode_step

    if floor is None or not floor.decode_batch_mean:
        return None
    context = floor.context_tokens_mean / floor.decode_batch_mean
    p = predict_engine_decode_step(cfg.model, cfg.tp, cfg.ep, cfg.attention_dp, floor.decode_batch_mean, context)
    return {"layout": p.layout, "decode_step_ms": None if p.step_s is None else p.step_s * 1e3,
            "communication_ms": None if p.communication_s is None else p.communication_s * 1e3,
            "note": p.reason}


def _check_fits(cfg: EngineBenchConfig, max_model_len: int) -> None:
    # a request that hits the context limit stops early, and output counts would not be exact
    if cfg.max_prompt + cfg.max_output > max_model_len:
        raise ValueError(f"--max-prompt + --max-output ({cfg.max_prompt + cfg.max_output}) exceeds "
                         f"the engine's context length {max_model_len}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (HF format)")
    parser.add_argument("--json", dest="json_path", required=True, metavar="OUT", help="write results here")
    defaults = EngineBenchConfig.__dataclass_fields__
    for name in ("num_requests", "min_prompt", "max_prompt", "min_output", "max_output", "seed",
                 "threads", "tp", "ep", "attention_dp", "max_num_seqs", "max_num_batched_tokens",
                 "hf_batch_size"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=defaults[name].default)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    parser.add_argument("--skip-hf", action="store_true", help="do not run the transformers baseline")
    parser.add_argument("--hf-max-requests", type=int, default=None,
                        help="run transformers on the first N requests only (whole batches)")
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="the engine's KV pool in GiB (default: $TOKENMILL_KV_CACHE_GB, else 1)")
    parser.add_argument("--profile", action="store_true",
                        help="then re-run the first requests with a per-operator breakdown of decode and "
                             "prefill steps (attention, experts, dense, sampling, scheduling, engine)")


def run(args: argparse.Namespace) -> int:
    fields = EngineBenchConfig.__dataclass_fields__
    try:
        cfg = EngineBenchConfig(**{name: getattr(args, name) for name in fields})
        report = run_engine_bench(cfg)
    except (ValueError, FileNotFoundError) as exc:
        log.error("bench engine: %s", exc)
        return 2
    render_table(report)
    if report.profile is not None:
        render_profile(report.profile)
    if cfg.json_path:
        write_json(report.to_json(), cfg.json_path)
        log.info("wrote %s", cfg.json_path)
    return 0
