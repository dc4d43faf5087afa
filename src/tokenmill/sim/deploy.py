"""Build an evaluation context from user-facing names, and the one-deployment estimate."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.sim.hardware import CPU_LOCAL_NAME, cpu_local_tuning, get_gpu
from tokenmill.sim.models import get_model
from tokenmill.sim.operators import OpContext
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.precision import PrecisionPlan
from tokenmill.sim.serving import Workload, aggregated
from tokenmill.sim.tuning import Tuning, tuning_for


def make_context(model: str, gpu: str, precision: str = "fp8", kv: str | None = None, backend: str | None = None) -> OpContext:
    """`cpu-local` without a backend uses the tuning `sim calibrate --model` fitted to tokenmill's own
    engine on this machine, when there is one; everything else a framework's fitted tuning."""
    m = get_model(model)
    spec = get_gpu(gpu)
    local = cpu_local_tuning() if spec.name == CPU_LOCAL_NAME and backend is None else {}
    tuning = Tuning().replace(**local) if local else tuning_for(backend, m.name)
    return OpContext(m, spec, PrecisionPlan.named(precision, kv, moe=m.is_moe), tuning)


@dataclass(slots=True, frozen=True)
class Estimate:
    ttft_ms: float
    tpot_ms: float
    output_tokens_per_s_per_gpu: float
    tokens_per_s_per_user: float
    memory_gb_per_gpu: float
    fits: bool

    def to_json(self) -> dict[str, float | bool]:
        """The CLI contract: exactly these six keys."""
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms,
                "output_tokens_per_s_per_gpu": self.output_tokens_per_s_per_gpu,
                "tokens_per_s_per_user": self.tokens_per_s_per_user, "memory_gb_per_gpu": self.memory_gb_per_gpu,
                "fits": self.fits}


def estimate(c: OpContext, par: Parallel, w: Workload, batch: int) -> Estimate:
    """One aggregated deployment (batch = requests in flight on the instance)."""
    if batch < 1:
        raise ValueError("estimate: field batch must be >= 1")
    par.check(c.model)
    r = aggregated(c, par, w, np.array([float(batch)]))
    return Estimate(ttft_ms=float(r.ttft[0] * 1e3), tpot_ms=float(r.tpot[0] * 1e3),
                    output_tokens_per_s_per_gpu=float(r.output_tps_per_gpu[0]),
                    tokens_per_s_per_user=float(r.tps_per_user[0]), memory_gb_per_gpu=float(r.memory_gb_per_gpu[0]),
                    fits=bool(r.fits[0]))
