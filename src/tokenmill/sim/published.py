"""Published figures the model is checked against (TensorRT-LLM tech blogs), as computations."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.sim.comms import alltoall_time, distinct_ranks
from tokenmill.sim.deploy import make_context
from tokenmill.sim.layouts import batch_grid
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.pareto import pareto_mask
from tokenmill.sim.search import run_search
from tokenmill.sim.serving import Workload, aggregated


@dataclass(slots=True, frozen=True)
class Case:
    group: str
    name: str
    value: float
    target: float
    tolerance: float  # relative band for check == "within"
    source: str
    check: str = "within"  # "within": |value/target - 1| <= tolerance; "above": value > target; "at_most": value <= target;
    # "rounds_to": value rounded to the decimals the target is stated with equals it

    @property
    def error(self) -> float:
        return self.value / self.target - 1.0

    @property
    def passed(self) -> bool:
        if self.check == "above":
            return self.value > self.target
        if self.check == "at_most":
            return self.value <= self.target
        if self.check == "rounds_to":
            decimals = len(f"{self.target:g}".partition(".")[2])
            return round(self.value, decimals) == self.target
        if self.check != "within":
            raise ValueError(f"case {self.name}: field check {self.check!r} unknown")
        return abs(self.error) <= self.tolerance


MIN_LATENCY_MTP3 = Workload(1024, 2048, 3, 3.10)


def min_latency_tps_per_user(workload: Workload) -> float:
    """Blog 1's min-latency recipe: NVFP4 MoE and dense FFN, attention and KV cache in BF16, TP8, batch 1."""
    c = make_context("deepseek-r1", "b200", "fp4", kv="bf16", backend="trtllm")
    r = aggregated(c, Parallel.of(8, 1, 1, 1), workload, np.array([1.0]))
    return float(r.tps_per_user[0])


def deepseek_b200_min_latency() -> list[Case]:
    """The blog's final figure: 368 tok/s/user with MTP3 at relaxed acceptance 3.10.

    Not checked: its "without MTP: 111" row. That row is the first of the MTP table the blog measured at an
    earlier stage (MTP3 then gave 253 TPS); the blog's later kernel work took MTP3 to 340 TPS (1.34x)
    before relaxed acceptance gave 368, so 111 describes an older software state than the figure checked.
    """
    src = "TensorRT-LLM tech blog 1 (DeepSeek-R1 min latency on B200): final figure, MTP3 at acceptance 3.10"
    value = min_latency_tps_per_user(MIN_LATENCY_MTP3)
    return [Case("published", "DS-R1 8xB200 TP8 b1 1K/2K MTP3, acceptance 3.10 tok/s/user", value, 368.0, 0.25, src)]


def max_throughput(layout: Parallel, gpu: str = "b200") -> float:
    c = make_context("deepseek-r1", gpu, "fp4", backend="trtllm")
    batches = batch_grid(16384)
    par = Parallel.of(*(np.repeat(getattr(layout, f), batches.size) for f in ("tp", "pp", "ep", "dp")))
    r = aggregated(c, par, Workload(1024, 2048), batches)
    return float(np.max(np.where(r.fits, r.output_tps_per_gpu, 0.0)))


def deepseek_b200_max_throughput() -> list[Case]:
    adp = max_throughput(Parallel.of(1, 1, 8, 8))
    tp = max_throughput(Parallel.of(8, 1, 8, 1))
    src = "TensorRT-LLM tech blog 3 (DeepSeek-R1 max throughput on B200: FP4, ADP8+EP8, 1K/2K)"
    return [Case("published", "DS-R1 8xB200 ADP8 EP8 max tok/s/GPU", adp, 4600.0, 0.25, src),
            Case("published", "attention-DP / attention-TP at max throughput (direction)", adp / tp, 1.0, 0.0, src, "above"),
            Case("published", "attention-DP / attention-TP at max throughput (size)", adp / tp, 4.0, 0.25, src)]


def disagg_gain(isl: int, osl: int, gpus: int = 72) -> float:
    """Median disagg/agg throughput ratio at equal tokens/s/user over the shared medium range."""
    c = make_context("deepseek-r1", "gb200", "fp4", backend="trtllm")
    res = run_search(c, Workload(isl, osl), gpus)
    curves = []
    for mode in (res.agg, res.disagg):
        ok = mode.feasible & np.isfinite(mode.tps_gpu)
        keep = np.flatnonzero(ok)[pareto_mask(mode.tps_user[ok], mode.tps_gpu[ok])]
        order = keep[np.argsort(mode.tps_user[keep])]
        curves.append((mode.tps_user[order], mode.tps_gpu[order]))
    lo = max(curves[0][0].min(), curves[1][0].min())
    hi = min(curves[0][0].max(), curves[1][0].max())
    grid = np.geomspace(lo, hi, 24)[4:-4]  # medium interactivity: drop both ends
    agg = np.interp(grid, *curves[0])
    dis = np.interp(grid, *curves[1])
    return float(np.median(dis / agg))


def deepseek_gb200_disagg() -> list[Case]:
    src = "TensorRT-LLM tech blog 5 (DeepSeek-R1 on GB200, disaggregated vs aggregated)"
    mid, long_in = disagg_gain(4400, 1200), disagg_gain(8192, 256)
    return [Case("published", "DS-R1 GB200 disagg/agg 4400/1200", mid, 1.6, 0.30, src),
            Case("published", "DS-R1 GB200 disagg/agg 8K/256", long_in, 2.0, 0.30, src),
            Case("published", "gain grows with ISL/OSL (8K/256 over 4400/1200)", long_in / mid, 1.0, 0.0, src, "above")]


def gb200_alltoall() -> list[Case]:
    """DeepSeek shape: hidden 7168, top-8 of 256, BF16, 128 tokens per rank."""
    g = make_context("deepseek-r1", "gb200", "bf16").gpu
    src = "TensorRT-LLM wide-EP blog (GB200 NVLink all-to-all kernel times)"
    cases = []
    for ep in (32, 64):
        nbytes = 128 * distinct_ranks(np.array([ep]), 8) * 7168 * 2.0
        t = float(alltoall_time(g, np.array([ep]), nbytes)[0]) * 1e6
        cases.append(Case("published", f"all-to-all dispatch EP{ep} 128 tok (us)", t, 40.0, 0.30, src))
        cases.append(Case("published", f"all-to-all combine EP{ep} 128 tok (us)", t, 42.0, 0.30, src))
    one = float(alltoall_time(g, np.array([32]), 1 * distinct_ranks(np.array([32]), 8) * 7168 * 2.0)[0]) * 1e6
    cases.append(Case("published", "all-to-all floor at 1 token (us)", one, 13.0, 0.30, src))
    return cases


def published_cases(include_slow: bool = True) -> list[Case]:
    cases = [*deepseek_b200_min_latency(), *deepseek_b200_max_throughput(), *gb200_alltoall()]
    if include_slow:
        cases += deepseek_gb200_disagg()
    return cases
