"""The step-time model as a per-step clock: `StepClock.seconds(StepWork)`.

One clock prices every step of a simulated fleet worker and, in `tokenmill serve --runner mock
--mock-profile MODEL@GPU[:precision][:layout]`, every step of a live mock worker, so the two
agree in time by construction. The step-time model (`sim.step_time`) is vectorised and costs
~100 µs a call on scalars, too slow for ~10⁵ steps, so the clock evaluates it once on a 4-D
grid (prefill tokens × their mean context × decode sequences × their mean context, per
attention-DP rank) and interpolates multilinearly between grid points (extrapolating the
last segment beyond the grid). Grid points are geometric, where the model bends (GEMM
efficiency saturates with rows); `test_fleet_clock` bounds the interpolation error.

Pipeline parallelism is priced as one pass through every stage (no micro-batch overlap).
"""
from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from tokenmill.sim.accounting import kv_bytes_per_token
from tokenmill.sim.deploy import make_context
from tokenmill.sim.memory import kv_capacity_tokens
from tokenmill.sim.operators import OpContext, StepShape
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.step_time import step_time
from tokenmill.step_work import StepWork

PREFILL_TOKENS = (0, 1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
PREFILL_CONTEXT = (1, 128, 512, 2048, 8192, 32768, 131072)
DECODE_SEQS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DECODE_CONTEXT = (1, 128, 512, 2048, 8192, 32768, 131072)
_LAYOUT_PART = re.compile(r"(tp|pp|ep|dp)(\d+)")


@dataclass(slots=True, frozen=True)
class Profile:
    """What a simulated (or mock) worker is: a model on a GPU at a precision in a layout."""

    model: str
    gpu: str
    precision: str = "fp8"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    backend: str | None = None  # whose fitted tuning (default: the simulator's default fit)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layout(self) -> str:
        return f"tp{self.tp}" + "".join(f"{k}{v}" for k, v in (("pp", self.pp), ("ep", self.ep), ("dp", self.dp)) if v > 1)

    def describe(self) -> str:
        return f"{self.model}@{self.gpu}:{self.precision}:{self.layout}"


def parse_layout(text: str, field_name: str = "layout") -> dict[str, int]:
    """`tp4`, `tp2ep2`, `tp1pp2`, `tp8ep8dp8` -> {"tp": .., "pp": .., "ep": .., "dp": ..}."""
    parts = _LAYOUT_PART.findall(text.lower())
    if not text or "".join(f"{k}{v}" for k, v in parts) != text.lower():
        raise ValueError(f"{field_name}: {text!r} is not a layout like tp4, tp2ep2 or tp1pp2dp2")
    sizes = {"tp": 1, "pp": 1, "ep": 1, "dp": 1}
    for key, value in parts:
        if int(value) < 1:
            raise ValueError(f"{field_name}: {key} must be >= 1 in {text!r}")
        sizes[key] = int(value)
    return sizes


def parse_profile(text: str, field_name: str = "--mock-profile") -> Profile:
    """`MODEL@GPU[:precision][:layout]`, e.g. `llama-3.1-8b@h100:fp8:tp1`."""
    model, sep, rest = text.partition("@")
    if not sep or not model or not rest:
        raise ValueError(f"{field_name}: {text!r} is not MODEL@GPU[:precision][:layout]")
    gpu, *extra = rest.split(":")
    if len(extra) > 2 or not gpu:
        raise ValueError(f"{field_name}: {text!r} is not MODEL@GPU[:precision][:layout]")
    precision, layout = "fp8", "tp1"
    for item in extra:
        if _LAYOUT_PART.match(item.lower()):
            layout = item
        else:
            precision = item
    return Profile(model, gpu, precision, **parse_layout(layout, field_name))


class StepClock:
    """Seconds per step for one profile; also KV capacity and KV transfer time."""

    def __init__(self, profile: Profile, context: OpContext | None = None) -> None:
        self.profile = profile
        self.context = context or make_context(profile.model, profile.gpu, profile.precision, backend=profile.backend)
        self.par = Parallel.of(profile.tp, profile.pp, profile.ep, profile.dp)
        self.par.check(self.context.model)
        self._axes = tuple(np.asarray(a, dtype=np.float64) for a in
                           (PREFILL_TOKENS, PREFILL_CONTEXT, DECODE_SEQS, DECODE_CONTEXT))
        self._table = self._tabulate()
        self._row_seconds = self._per_sampled_row()
        self._axes_lists = tuple(a.tolist() for a in self._axes)

    @classmethod
    def from_text(cls, text: str, field_name: str = "--mock-profile") -> "StepClock":
        return cls(parse_profile(text, field_name))

    # ---- the step ------------------------------------------------------------------------

    def direct(self, work: StepWork) -> float:
        """The step-time model evaluated for this one step (slow; the reference `seconds` follows)."""
        return float(step_time(self.context, self.par, self._shape(work)).total[0])

    def seconds(self, work: StepWork) -> float:
        dp = self.profile.dp
        p = work.prefill_tokens / dp
        pc = work.prefill_attended / work.prefill_tokens if work.prefill_tokens else 1.0
        s = work.decode_seqs / dp
        dc = work.decode_kv_tokens / work.decode_seqs if work.decode_seqs else 1.0
        prefill_rows = max(work.sampled - work.decode_seqs, 0) / dp
        return self._interpolate((p, pc, s, dc)) + prefill_rows * self._row_seconds

    def _shape(self, work: StepWork) -> StepShape:
        dp = self.profile.dp
        pc = work.prefill_attended / work.prefill_tokens if work.prefill_tokens else 1.0
        dc = work.decode_kv_tokens / work.decode_seqs if work.decode_seqs else 1.0
        rows = max(work.sampled - work.decode_seqs, 0) / dp
        return StepShape(np.full(1, work.prefill_tokens / dp), np.full(1, pc), np.full(1, work.decode_seqs / dp),
                         np.full(1, dc), output_rows=np.full(1, rows))

    def _tabulate(self) -> np.ndarray:
        grids = np.meshgrid(*self._axes, indexing="ij")
        shape = StepShape(grids[0].ravel(), grids[1].ravel(), grids[2].ravel(), grids[3].ravel())
        par = Parallel.of(*(np.full(shape.prefill_tokens.size, v) for v in (self.profile.tp, self.profile.pp,
                                                                                self.profile.ep, self.profile.dp)))
        return step_time(self.context, par, shape).total.reshape(grids[0].shape)

    def _per_sampled_row(self) -> float:
        """LM head and host work of one more sampled row (a prefill finishing this step)."""
        base = StepShape(np.full(1, 512.0), np.full(1, 256.0), np.full(1, 8.0), np.full(1, 1024.0))
        plus = StepShape(base.prefill_tokens, base.prefill_ctx, base.decode_seqs, base.decode_ctx, output_rows=1.0)
        return float((step_time(self.context, self.par, plus).total - step_time(self.context, self.par, base).total)[0])

    def _interpolate(self, point: tuple[float, float, float, float]) -> float:
        corners: list[tuple[int, float]] = []
        for axis, x in zip(self._axes_lists, point):
            i = min(max(bisect_right(axis, x) - 1, 0), len(axis) - 2)
            corners.append((i, (x - axis[i]) / (axis[i + 1] - axis[i])))
        (i0, t0), (i1, t1), (i2, t2), (i3, t3) = corners
        table = self._table
        total = 0.0
        for a, wa in ((i0, 1.0 - t0), (i0 + 1, t0)):
            for b, wb in ((i1, 1.0 - t1), (i1 + 1, t1)):
                for c, wc in ((i2, 1.0 - t2), (i2 + 1, t2)):
                    w = wa * wb * wc
                    if w:
                        total += w * ((1.0 - t3) * table[a, b, c, i3] + t3 * table[a, b, c, i3 + 1])
        return float(total)

    # ---- memory and transfers -------------------------------------------------------------

    def kv_capacity_tokens(self) -> int:
        """KV tokens the whole instance can cache (every attention-DP rank), 0 if the weights do not fit."""
        c = self.context
        return int(np.asarray(kv_capacity_tokens(c.model, c.gpu, self.par, c.plan)).ravel()[0]) * self.profile.dp

    def kv_bytes(self, tokens: int) -> float:
        c = self.context
        return tokens * kv_bytes_per_token(c.model, c.plan.kv.bytes_per_value, tokens)

    def transfer_seconds(self, tokens: int, receiver_gpus: int) -> float:
        """Moving `tokens` of KV from this (prefill) instance, all its GPUs sending, to a decode
        instance of `receiver_gpus`: over NVLink when both fit in one NVLink domain, else the NIC."""
        g = self.context.gpu
        same_domain = self.profile.gpus + receiver_gpus <= g.domain_size
        bw = (g.nvlink_bw if same_domain else g.scaleout_bw) * g.link_eff * self.profile.gpus
        return g.collective_latency_s + self.kv_bytes(tokens) / bw
