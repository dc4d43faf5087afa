"""`tokenmill sim report`: the trend study as PNG plots and a markdown summary."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from tokenmill.sim.deploy import make_context
from tokenmill.sim.disagg import decode_pool
from tokenmill.sim.layouts import batch_grid, cross
from tokenmill.sim.operators import OpContext
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.pareto import pareto_mask
from tokenmill.sim.plots import plot_lines
from tokenmill.sim.search import ModePoints, run_search
from tokenmill.sim.serving import Workload

log = logging.getLogger(__name__)
WORKLOADS = ((1024, 1024), (4400, 1200), (8192, 1024), (8192, 256))
ITL_TARGETS_MS = np.array([10.0, 15.0, 20.0, 30.0, 50.0, 75.0, 100.0])
TTFT_LIMIT_S = 2.0
BUDGET = 72


def _context() -> OpContext:
    return make_context("deepseek-r1", "gb200", "fp4", backend="trtllm")


def _frontier(points: ModePoints) -> tuple[np.ndarray, np.ndarray]:
    ok = np.flatnonzero(points.feasible & (points.ttft <= TTFT_LIMIT_S))
    keep = ok[pareto_mask(points.tps_user[ok], points.tps_gpu[ok])]
    order = keep[np.argsort(points.tps_user[keep])]
    return points.tps_user[order], points.tps_gpu[order]


def disagg_advantage(out: Path) -> tuple[list[str], dict]:
    series, lines, results = [], [], {}
    for isl, osl in WORKLOADS:
        res = run_search(_context(), Workload(isl, osl), BUDGET)
        (ax, ay), (dx, dy) = _frontier(res.agg), _frontier(res.disagg)
        grid = np.geomspace(max(ax.min(), dx.min()), min(ax.max(), dx.max()), 20)
        ratio = np.interp(grid, dx, dy) / np.interp(grid, ax, ay)
        series.append((f"ISL {isl} / OSL {osl}", grid, ratio))
        results[(isl, osl)] = (ratio, res)
        peak = int(np.argmax(ratio))
        where = np.log(grid[peak] / grid[0]) / np.log(grid[-1] / grid[0])  # 0: lowest interactivity, 1: highest
        lines.append(f"| {isl}/{osl} | {np.median(ratio):.2f} | {ratio.max():.2f} at {grid[peak]:.0f} tok/s/user "
                     f"({where:.0%} up the range) | {ratio[0]:.2f} / {ratio[-1]:.2f} |")
    plot_lines(series, f"DeepSeek-R1 FP4, {BUDGET}x GB200: disaggregated / aggregated tok/s/GPU", "tokens/s/user",
               "throughput ratio at equal tokens/s/user", out / "disagg_advantage.png", logx=True)
    head = ["## Disaggregation advantage (DeepSeek-R1 FP4, 72x GB200, TTFT <= 2 s)", "",
            "| ISL/OSL | median ratio | peak ratio | ratio at lowest / highest interactivity |", "|---|---|---|---|"]
    return head + lines + ["", "![](disagg_advantage.png)", ""], results


def wide_ep(out: Path, itl_ms: float = 50.0) -> list[str]:
    """Best decode tok/s/GPU at an ITL target for EP sizes, inside one NVL72 domain vs 8-GPU domains."""
    eps = np.array([8, 16, 32, 64])
    series, rows = [], []
    for label, domain in (("NVL72 domain (72)", 72), ("8-GPU domains", 8)):
        base = _context()
        c = OpContext(base.model, base.gpu.with_overrides(domain_size=domain), base.plan, base.tuning)
        best = []
        for ep in eps:
            par, batch = cross(Parallel.of(1, 1, int(ep), int(ep)), batch_grid(65536))
            pool = decode_pool(c, par, Workload(1024, 1024), batch)
            ok = pool.fits & (pool.tpot <= itl_ms / 1e3)
            tps = np.where(ok, batch / pool.tpot / par.gpus, 0.0)
            best.append(float(tps.max()))
        series.append((label, eps.astype(float), np.array(best)))
        rows.append(f"| {label} | " + " | ".join(f"{b:.0f}" for b in best) + " |")
    plot_lines(series, f"DeepSeek-R1 FP4 decode, best tok/s/GPU at ITL <= {itl_ms:.0f} ms", "EP size (attention-DP = EP)",
               "output tokens/s/GPU", out / "wide_ep.png")
    return [f"## Wide expert parallelism for decode (1K/1K, ITL <= {itl_ms:.0f} ms)", "",
            "| fabric | EP8 | EP16 | EP32 | EP64 |", "|---|---|---|---|---|", *rows, "", "![](wide_ep.png)", ""]


def decode_prefill_ratio(out: Path, results: dict) -> list[str]:
    series, rows = [], []
    for isl, osl in ((1024, 1024), (8192, 1024)):
        d = results[(isl, osl)][1].disagg
        ratios = []
        for itl in ITL_TARGETS_MS:
            ok = d.feasible & (d.tpot <= itl / 1e3) & (d.ttft <= TTFT_LIMIT_S)
            if not ok.any():
                ratios.append(np.nan)
                continue
            i = int(np.flatnonzero(ok)[np.argmax(d.tps_gpu[ok])])
            pre = d.detail["prefill_workers"][i] * d.detail["prefill_tp"][i] * d.detail["prefill_dp"][i] * d.detail["prefill_pp"][i]
            dec = d.detail["decode_workers"][i] * d.detail["decode_tp"][i] * d.detail["decode_dp"][i] * d.detail["decode_pp"][i]
            ratios.append(dec / pre)
        series.append((f"ISL {isl} / OSL {osl}", ITL_TARGETS_MS, np.array(ratios)))
        rows.append(f"| {isl}/{osl} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    plot_lines(series, "Best decode:prefill GPU ratio vs ITL target (DeepSeek-R1 FP4, GB200)", "ITL target (ms)",
               "decode GPUs / prefill GPUs", out / "decode_prefill_ratio.png", logx=True)
    head = "| ISL/OSL | " + " | ".join(f"ITL {t:.0f} ms" for t in ITL_TARGETS_MS) + " |"
    return ["## Best decode:prefill GPU ratio vs ITL target", "", head, "|---" * (len(ITL_TARGETS_MS) + 1) + "|", *rows,
            "", "![](decode_prefill_ratio.png)", ""]


def write_report(out: Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    parts, results = disagg_advantage(out)
    text = ["# tokenmill sim trend study", "",
            "Model: DeepSeek-R1 (NVFP4 experts and dense FFN, FP8 attention and KV), TensorRT-LLM-fitted tuning.",
            "Aggregated attention-DP layouts are searched with and without ADP balance. Throughput is output tokens/s/GPU;",
            "interactivity is tokens/s/user = 1/TPOT. Numbers are simulator output, not measurements.",
            "Decode batches are capped at the engine's slots per attention-DP rank (TensorRT-LLM recipe: 384).", "",
            *parts, *wide_ep(out), *decode_prefill_ratio(out, results)]
    path = out / "README.md"
    path.write_text("\n".join(text) + "\n")
    return path
