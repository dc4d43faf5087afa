"""`tokenmill sim calibrate`: measure this machine into a `cpu-local` GPU entry.

Also `step_coefficients(model, gpu)`: a linear fit of the step-time model, for the mock runner:
`t = a + b * prefill_tokens + c * decode_seqs + d * kv_tokens_read` (seconds).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.sim.hardware import (
    CPU_LOCAL_DEFAULT_POWER_W,
    CPU_LOCAL_NAME,
    CPU_LOCAL_POWER_SOURCE,
    GpuSpec,
    cpu_local_path,
)
from tokenmill.sim.models import ModelConfig
from tokenmill.sim.operators import OpContext, StepShape
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.precision import PrecisionPlan
from tokenmill.sim.step_time import step_time
from tokenmill.sim.tuning import Tuning

log = logging.getLogger(__name__)


def _best_time(fn, repeats: int) -> float:
    """Fastest of `repeats` runs: the least-disturbed measurement on a shared machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_flops(dtype: str, n: int, repeats: int) -> float:
    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    a = torch.randn(n, n, dtype=torch_dtype)
    b = torch.randn(n, n, dtype=torch_dtype)
    return 2.0 * n**3 / _best_time(lambda: torch.matmul(a, b), repeats)


def measure_memory_bandwidth(megabytes: int, repeats: int) -> float:
    """Copy bandwidth counting read + write bytes."""
    src = np.ones(megabytes * 1024 * 1024 // 8)
    dst = np.empty_like(src)
    return 2.0 * src.nbytes / _best_time(lambda: np.copyto(dst, src), repeats)


def measure_op_latency(repeats: int) -> float:
    """Per-op overhead of a tiny torch op (what a kernel launch costs on CPU)."""
    import torch

    x = torch.ones(8, 8)
    count = 200
    return _best_time(lambda: [torch.add(x, x) for _ in range(count)], repeats) / count


def calibrate_local(out: Path | None = None, quick: bool = False, model: str | None = None, threads: int = 1) -> Path:
    n, reps, mb = (256, 3, 64) if quick else (1024, 5, 256)
    bf16, fp32 = measure_matmul_flops("bf16", n, reps), measure_matmul_flops("fp32", n, reps)
    # Without native bf16 (no AVX-512 BF16/AMX) torch's bf16 matmul crawls, and tokenmill's own
    # kernels widen bf16 weights to fp32 instead: a bf16 model then computes at the fp32 rate.
    bf16_source = f"torch bf16 matmul {n}^3" if bf16 >= fp32 else \
        f"fp32 matmul {n}^3: torch's bf16 matmul reached only {bf16 / 1e9:.1f} GFLOP/s here (no native bf16), " \
        "and the engine's kernels widen bf16 to fp32"
    bf16 = max(bf16, fp32)
    bw, lat = measure_memory_bandwidth(mb, reps), measure_op_latency(reps)
    log.info("cpu-local: bf16 %.1f GFLOP/s, fp32 %.1f GFLOP/s, %.1f GB/s, op %.1f us", bf16 / 1e9, fp32 / 1e9, bw / 1e9, lat * 1e6)
    mem_gb = _total_memory_gb()
    path = Path(out).expanduser() if out else cpu_local_path()
    power_w, power_src = _previous_power(path)
    measured = f"measured by tokenmill sim calibrate on {time.strftime('%Y-%m-%d')}"
    entry = {"name": CPU_LOCAL_NAME, "display_name": "this machine (CPU)", "bf16_flops": bf16, "fp8_flops": bf16,
             "fp4_flops": bf16, "fp32_flops": fp32, "hbm_gb": mem_gb, "hbm_bw": bw, "nvlink_bw": bw / 4,
             "domain_size": 1, "scaleout_bw": 1.25e9, "kernel_latency_s": lat, "collective_latency_s": 50e-6,
             "a2a_latency_s": 50e-6, "gemm_eff_max": 1.0, "gemm_m_half": 1.0, "attn_eff": 0.5, "mem_eff": 1.0, "link_eff": 1.0,
             "power_w": power_w,
             "sources": {"bf16_flops": f"{measured} ({bf16_source}); fp8/fp4 run at this rate",
                         "fp32_flops": measured, "hbm_bw": f"{measured} (numpy copy, read+write)",
                         "kernel_latency_s": f"{measured} (tiny torch op)", "hbm_gb": "os.sysconf physical memory",
                         "gemm_eff_max": "1.0: the measured rate already is the achieved rate",
                         "power_w": power_src}}
    _measure_links(entry, measured)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry, indent=1) + "\n")
    if model is not None:
        _fit_to_engine(entry, path, model, threads, measured)
    return path


def _measure_links(entry: dict[str, Any], measured: str) -> None:
    """The link between rank processes (what a parallel worker's collectives cross here): the
    engine's own collectives on two ranks (shared memory, or gloo over loopback where the
    native rank sync does not build), each fitted as latency + bytes ÷ bandwidth. The ranks
    share one host, so every rank count sits in one "domain"."""
    cores = os.cpu_count() or 1
    if cores < 2:
        log.info("cpu-local: one core, no rank-to-rank link to measure")
        return
    from tokenmill.engine.parallel.collective_probe import measure

    timings = measure(world=2)
    latency, bandwidth = _latency_and_bandwidth([(t.nbytes, t.seconds) for t in timings if t.op == "all_reduce"])
    # the exchange is two phases (all-gather, reduce-scatter), each charged an all-to-all latency
    pair_latency, _ = _latency_and_bandwidth([(t.nbytes, t.seconds) for t in timings if t.op == "exchange"])
    log.info("cpu-local: rank link %.0f us all-reduce latency, %.2f GB/s; exchange phase %.0f us",
             latency * 1e6, bandwidth / 1e9, pair_latency / 2 * 1e6)
    entry.update(collective_latency_s=latency, nvlink_bw=bandwidth, a2a_latency_s=pair_latency / 2,
                 domain_size=cores)
    note = f"{measured} (the engine's collectives between 2 rank processes, latency + bytes/bandwidth fit)"
    entry["sources"].update({name: note for name in ("collective_latency_s", "nvlink_bw", "a2a_latency_s")})
    entry["sources"]["domain_size"] = "every rank of a parallel worker runs on this host"


def _latency_and_bandwidth(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Latency from the smallest message, bandwidth from the slope up to the largest (a
    least-squares line would let the large messages' noise set the latency, even below zero)."""
    (small, t_small), (large, t_large) = min(points), max(points)
    if t_large <= t_small:  # noise swamped the slope: the large message's own rate, a lower bound
        return t_small, large / t_large
    return t_small, (large - small) / (t_large - t_small)


def _fit_to_engine(entry: dict, path: Path, model: str, threads: int, measured: str) -> None:
    """Refit the entry's efficiency/latency fields and the engine's overheads to its real steps."""
    from tokenmill.sim.engine_fit import fit_engine, measure_engine_steps
    from tokenmill.sim.hardware import load_gpu_file

    samples = measure_engine_steps(model, threads)
    fit = fit_engine(model, load_gpu_file(path), samples)
    log.info("cpu-local: engine steps of %s fitted, median error %.1f%% over %d shapes", model,
             100 * fit.median_error, fit.samples)
    entry.update(fit.gpu_fields)
    entry["tuning"] = fit.tuning_fields
    note = (f"{measured}: fitted to tokenmill's engine steps of {Path(model).name} ({threads} thread(s), "
            f"{fit.samples} shapes, median error {100 * fit.median_error:.1f}%)")
    entry["sources"].update({field: note for field in fit.gpu_fields} | {"tuning": note})
    path.write_text(json.dumps(entry, indent=1) + "\n")


def _previous_power(path: Path) -> tuple[float, str]:
    """Power is not measured: keep a figure the user wrote into an earlier calibration file, else the
    stated assumption, so recalibrating never silently throws an edit away."""
    try:
        old = json.loads(path.read_text())
        power = float(old["power_w"])
    except (OSError, ValueError, KeyError, TypeError):
        return CPU_LOCAL_DEFAULT_POWER_W, CPU_LOCAL_POWER_SOURCE
    if not power > 0 or power == CPU_LOCAL_DEFAULT_POWER_W:
        return CPU_LOCAL_DEFAULT_POWER_W, CPU_LOCAL_POWER_SOURCE
    log.info("cpu-local: keeping power_w %.0f W from %s", power, path)
    sources = old.get("sources")
    source = sources.get("power_w") if isinstance(sources, dict) else None
    if not isinstance(source, str) or source.startswith(CPU_LOCAL_POWER_SOURCE):
        source = f"set by the user in {path.name} (not measured), kept by tokenmill sim calibrate"
    return power, source


def _total_memory_gb() -> float:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


@dataclass(slots=True, frozen=True)
class StepCoefficients:
    """Seconds: t = a + b * prefill_tokens + c * decode_seqs + d * kv_tokens_read."""

    a: float
    b: float
    c: float
    d: float

    def step_seconds(self, prefill_tokens: float, decode_seqs: float, kv_tokens_read: float) -> float:
        return self.a + self.b * prefill_tokens + self.c * decode_seqs + self.d * kv_tokens_read


def step_coefficients(model: ModelConfig, gpu: GpuSpec, precision: str = "bf16", tuning: Tuning | None = None,
                      max_prefill: int = 512, max_seqs: int = 32, max_ctx: int = 2048) -> StepCoefficients:
    """Least-squares fit (non-negative, by clipping) of the single-GPU step-time model over a grid of steps."""
    c = OpContext(model, gpu, PrecisionPlan.named(precision, moe=model.is_moe), tuning or Tuning())
    p, s, k = np.meshgrid(np.linspace(0, max_prefill, 5), np.linspace(0, max_seqs, 5), np.linspace(16, max_ctx, 5), indexing="ij")
    p, s, k = p.ravel(), s.ravel(), k.ravel()
    shape = StepShape(prefill_tokens=p, prefill_ctx=np.maximum(p / 2, 1), decode_seqs=s, decode_ctx=k)
    t = step_time(c, Parallel.of(1, 1, 1, 1), shape).total
    design = np.column_stack([np.ones_like(p), p, s, s * k])
    coef, *_ = np.linalg.lstsq(design, t, rcond=None)
    a, b, cc, d = (max(float(x), 0.0) for x in coef)
    return StepCoefficients(a=a, b=b, c=cc, d=d)
