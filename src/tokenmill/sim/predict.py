"""Predict TTFT and TPOT for silicon rows, grouped so each group is one vectorised call."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenmill.sim.disagg import closed_loop, decode_pool
from tokenmill.sim.hardware import GpuSpec, get_gpu
from tokenmill.sim.models import ModelConfig, get_model
from tokenmill.sim.operators import OpContext
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.precision import PrecisionPlan
from tokenmill.sim.serving import Workload, aggregated
from tokenmill.sim.silicon import Layout, SiliconRow
from tokenmill.sim.tuning import Tuning, pick_tuning


@dataclass(slots=True, frozen=True)
class Predictions:
    ttft_ms: np.ndarray
    tpot_ms: np.ndarray


def _par(layouts: Sequence[Layout]) -> Parallel:
    return Parallel.of([x.tp for x in layouts], [x.pp for x in layouts], [x.ep for x in layouts], [x.dp for x in layouts])


def _group_key(r: SiliconRow) -> tuple:
    return (r.backend, r.model, r.gpu, r.precision, r.mode, r.isl, r.osl)


def _predict_agg(c: OpContext, w: Workload, rows: list[SiliconRow]) -> tuple[np.ndarray, np.ndarray]:
    par = _par([r.agg for r in rows])
    res = aggregated(c, par, w, np.array([r.concurrency for r in rows], float), np.array([r.batch for r in rows], float))
    return res.ttft, res.tpot


def _predict_disagg(c: OpContext, w: Workload, rows: list[SiliconRow]) -> tuple[np.ndarray, np.ndarray]:
    pre_par, dec_par = _par([r.prefill for r in rows]), _par([r.decode for r in rows])
    concurrency = np.array([r.concurrency for r in rows], float)
    n_prefill = np.array([r.prefill_workers for r in rows], float)
    n_decode = np.array([r.decode_workers for r in rows], float)
    total_gpus = n_prefill * pre_par.gpus + n_decode * dec_par.gpus
    tpot = decode_pool(c, dec_par, w, np.maximum(concurrency / n_decode, 1.0)).tpot
    return closed_loop(c, pre_par, w, n_prefill, concurrency, tpot, total_gpus <= c.gpu.domain_size), tpot


def predict_rows(rows: Sequence[SiliconRow], tunings: dict[str, Tuning], models: dict[str, ModelConfig] | None = None,
                 gpus: dict[str, GpuSpec] | None = None) -> Predictions:
    """TTFT/TPOT in ms for each row, in row order; `tunings` maps backend (or "backend/model") -> Tuning."""
    models = models if models is not None else {}
    gpus = gpus if gpus is not None else {}
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[_group_key(r)].append(i)
    ttft, tpot = np.zeros(len(rows)), np.zeros(len(rows))
    for (backend, model, gpu, precision, mode, isl, osl), idx in groups.items():
        m = models.setdefault(model, get_model(model))
        g = gpus.setdefault(gpu, get_gpu(gpu))
        c = OpContext(m, g, PrecisionPlan.named(precision, moe=m.is_moe), pick_tuning(tunings, backend, model if mode == "agg" else None))
        members = [rows[i] for i in idx]
        fn = _predict_disagg if mode == "disagg" else _predict_agg
        group_ttft, group_tpot = fn(c, Workload(isl, osl), members)
        ttft[idx], tpot[idx] = group_ttft * 1e3, group_tpot * 1e3
    return Predictions(ttft_ms=ttft, tpot_ms=tpot)
