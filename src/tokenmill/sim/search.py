"""Deployment search: aggregated and disaggregated design points for one model, GPU and budget."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from tokenmill.sim.disagg import decode_pool, prefill_pool, rate_matched
from tokenmill.sim.layouts import batch_grid, cross, enumerate_layouts
from tokenmill.sim.operators import OpContext
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.serving import Workload, aggregated

PREFILL_PROMPTS = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
PREFILL_SHORTLIST = 12  # prefill configs kept for rate matching (best throughput per latency band)
MAX_PREFILL_INSTANCES = 16
MAX_DECODE_INSTANCES = 32


@dataclass(slots=True)
class ModePoints:
    """Flattened design points of one serving mode; `detail` holds per-point layout columns."""

    tps_user: np.ndarray
    tps_gpu: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    feasible: np.ndarray
    detail: dict[str, np.ndarray] = field(default_factory=dict)

    def describe(self, i: int) -> dict[str, float]:
        out = {k: float(v[i]) for k, v in self.detail.items()}
        out.update(ttft_ms=float(self.ttft[i] * 1e3), tpot_ms=float(self.tpot[i] * 1e3),
                   tokens_per_s_per_user=float(self.tps_user[i]), output_tokens_per_s_per_gpu=float(self.tps_gpu[i]))
        return out


@dataclass(slots=True)
class SearchResult:
    agg: ModePoints
    disagg: ModePoints
    points_evaluated: int
    seconds: float


def _layout_columns(prefix: str, par: Parallel) -> dict[str, np.ndarray]:
    return {f"{prefix}tp": par.tp, f"{prefix}pp": par.pp, f"{prefix}ep": par.ep, f"{prefix}dp": par.dp}


def search_aggregated(c: OpContext, w: Workload, gpu_budget: int) -> ModePoints:
    """Every layout x batch; attention-DP layouts also with the engine's ADP balance on (a design choice:
    it trades TTFT for not waiting on the busiest rank's prefill every step)."""
    par, batch = cross(enumerate_layouts(c.model, gpu_budget), batch_grid())
    res = aggregated(c.with_tuning(adp_balance=False), par, w, batch)
    detail = _layout_columns("", par) | {"batch": batch, "gpus": par.gpus.astype(float), "adp_balance": np.zeros(batch.size)}
    points = ModePoints(res.tps_per_user, res.output_tps_per_gpu, res.ttft, res.tpot, res.fits, detail)
    adp = np.flatnonzero(par.dp > 1)
    if adp.size == 0:
        return points
    bpar = Parallel.of(par.tp[adp], par.pp[adp], par.ep[adp], par.dp[adp])
    bal = aggregated(c.with_tuning(adp_balance=True), bpar, w, batch[adp])
    bdetail = _layout_columns("", bpar) | {"batch": batch[adp], "gpus": bpar.gpus.astype(float), "adp_balance": np.ones(adp.size)}
    balanced = ModePoints(bal.tps_per_user, bal.output_tps_per_gpu, bal.ttft, bal.tpot, bal.fits, bdetail)
    return _concat(points, balanced)


def _concat(a: ModePoints, b: ModePoints) -> ModePoints:
    cat = np.concatenate
    return ModePoints(cat([a.tps_user, b.tps_user]), cat([a.tps_gpu, b.tps_gpu]), cat([a.ttft, b.ttft]),
                      cat([a.tpot, b.tpot]), cat([a.feasible, b.feasible]), {k: cat([a.detail[k], b.detail[k]]) for k in a.detail})


def _prefill_shortlist(c: OpContext, w: Workload, gpu_budget: int, same_domain: bool):
    """Prefill configs on the latency/efficiency frontier (lowest GPU-seconds per request at each latency)."""
    par, prompts = cross(enumerate_layouts(c.model, gpu_budget), PREFILL_PROMPTS)
    pool = prefill_pool(c, par, w, prompts, same_domain)
    cost = np.where(pool.fits, pool.service * pool.gpus, np.inf)
    order = np.argsort(pool.latency)
    running = np.minimum.accumulate(cost[order])
    frontier = order[cost[order] <= running + 1e-15]
    frontier = frontier[np.isfinite(cost[frontier])]
    pick = frontier[np.linspace(0, frontier.size - 1, min(PREFILL_SHORTLIST, frontier.size)).astype(int)]
    return par, prompts, pool, np.unique(pick), par.tp.size


def search_disaggregated(c: OpContext, w: Workload, gpu_budget: int) -> tuple[ModePoints, int]:
    """Shortlisted prefill configs x every decode config x every instance-count pair in the budget."""
    same_domain = gpu_budget <= c.gpu.domain_size
    p_par, p_prompts, p_pool, pick, p_evaluated = _prefill_shortlist(c, w, gpu_budget, same_domain)
    d_par, d_batch = cross(enumerate_layouts(c.model, gpu_budget), batch_grid())
    d_pool = decode_pool(c, d_par, w, d_batch)
    xs, ys = np.meshgrid(np.arange(1, MAX_PREFILL_INSTANCES + 1), np.arange(1, MAX_DECODE_INSTANCES + 1), indexing="ij")
    xs, ys = xs.ravel().astype(float), ys.ravel().astype(float)
    P, D, R = pick[:, None, None], np.arange(d_batch.size)[None, :, None], np.arange(xs.size)[None, None, :]
    gpus = xs[R] * p_pool.gpus[P] + ys[R] * d_pool.gpus[D]
    P, D, R = (np.broadcast_to(a, gpus.shape)[gpus <= gpu_budget] for a in (P, D, R))
    sub = lambda pool, idx: type(pool)(*(getattr(pool, f)[idx] for f in pool.__slots__))  # noqa: E731
    res = rate_matched(sub(p_pool, P), sub(d_pool, D), w, xs[R], ys[R])
    detail = _layout_columns("prefill_", Parallel.of(p_par.tp[P], p_par.pp[P], p_par.ep[P], p_par.dp[P]))
    detail |= _layout_columns("decode_", Parallel.of(d_par.tp[D], d_par.pp[D], d_par.ep[D], d_par.dp[D]))
    detail |= {"prefill_prompts_per_step": p_prompts[P], "decode_batch": d_batch[D], "prefill_workers": xs[R],
               "decode_workers": ys[R], "gpus": res.gpus}
    points = ModePoints(1.0 / res.tpot, res.output_tps_per_gpu, res.ttft, res.tpot, res.fits, detail)
    return points, p_evaluated + d_batch.size + R.size


def run_search(c: OpContext, w: Workload, gpu_budget: int) -> SearchResult:
    if gpu_budget < 1:
        raise ValueError("search: field gpus must be >= 1")
    start = time.perf_counter()
    agg = search_aggregated(c, w, gpu_budget)
    disagg, disagg_points = search_disaggregated(c, w, gpu_budget)
    return SearchResult(agg=agg, disagg=disagg, points_evaluated=agg.tps_gpu.size + disagg_points,
                        seconds=time.perf_counter() - start)
