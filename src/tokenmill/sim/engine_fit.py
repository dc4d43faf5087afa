"""`tokenmill sim calibrate --model DIR`: fit the `cpu-local` entry to tokenmill's own engine steps.

Peak FLOP/s and copy bandwidth (`local_calibrate`) say what the silicon can do, not what an eager
PyTorch engine gets from it: small-M GEMMs run far below the copy rate, every op costs host time,
and every step and sequence carries Python work. So the real engine is timed on the model for a
grid of step shapes (decode batches at two context lengths, single prefills of several lengths),
and five fields of the step-time model are fitted to those times by coordinate descent on the
log error: the GPU entry's `kernel_latency_s`, `mem_eff` and `gemm_eff_max`, and the tuning's
`step_overhead_s` and `seq_overhead_s` (stored in the entry's `tuning`, which the simulator uses
for `cpu-local`). Each sample is the median of repeated steps; the fit reports its median error.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.sim.hardware import GpuSpec
from tokenmill.sim.models import get_model
from tokenmill.sim.operators import OpContext, StepShape
from tokenmill.sim.parallel import Parallel
from tokenmill.sim.precision import PrecisionPlan
from tokenmill.sim.step_time import step_time
from tokenmill.sim.tuning import Tuning
from tokenmill.step_work import StepWork

log = logging.getLogger(__name__)

DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_CONTEXTS = (128, 512)
PREFILL_LENGTHS = (16, 64, 256, 512)
GPU_FIELDS = ("kernel_latency_s", "mem_eff", "gemm_eff_max")
TUNING_FIELDS = ("step_overhead_s", "seq_overhead_s")
BOUNDS = {"kernel_latency_s": (1e-7, 1e-2), "mem_eff": (1e-3, 1.0), "gemm_eff_max": (1e-3, 1.0),
          "step_overhead_s": (0.0, 0.5), "seq_overhead_s": (0.0, 0.05)}


@dataclass(slots=True, frozen=True)
class StepSample:
    work: StepWork
    seconds: float


@dataclass(slots=True, frozen=True)
class EngineFit:
    gpu_fields: dict[str, float]
    tuning_fields: dict[str, float]
    median_error: float  # |model / measured - 1|, median over the samples
    samples: int


def measure_engine_steps(model_dir: str | Path, threads: int, repeats: int = 5) -> list[StepSample]:
    """Median wall time of the real engine's steps for the calibration grid."""
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.textgen.sampling import SamplingParams

    longest = max(max(DECODE_BATCHES) * max(DECODE_CONTEXTS), max(PREFILL_LENGTHS))
    engine = LLMEngine(EngineConfig(model=str(model_dir), threads=threads, max_num_seqs=max(DECODE_BATCHES),
                                    max_num_batched_tokens=longest, enable_prefix_caching=False))
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    samples = []
    for length in PREFILL_LENGTHS:
        times = []
        for _ in range(repeats):
            _add(engine, [rng.integers(3, vocab, length).tolist()], SamplingParams(max_tokens=1, ignore_eos=True))
            times.append(_timed_step(engine))
            _drain(engine)
        samples.append(StepSample(StepWork(length, StepWork.chunk_attended(0, length), length, 0, 0, 1),
                                  statistics.median(times)))
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            samples.append(_decode_sample(engine, rng, vocab, batch, context, repeats))
    engine.close()
    return samples


def _add(engine, prompts: list[list[int]], params) -> None:
    for prompt in prompts:
        engine.add_request(f"cal-{time.perf_counter_ns()}-{len(prompt)}", prompt, params)


def _timed_step(engine) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def _decode_sample(engine, rng, vocab: int, batch: int, context: int, repeats: int) -> StepSample:
    from tokenmill.textgen.sampling import SamplingParams

    params = SamplingParams(max_tokens=repeats + 2, ignore_eos=True, temperature=0.0)
    _add(engine, [rng.integers(3, vocab, context).tolist() for _ in range(batch)], params)
    engine.step()  # every prompt in one prefill step (the token budget holds them all)
    times = [_timed_step(engine) for _ in range(repeats)]
    _drain(engine)
    mid = context + 1 + repeats // 2
    return StepSample(StepWork(0, 0.0, 0, batch, batch * mid, batch), statistics.median(times))


def _predict(model, gpu: GpuSpec, tuning: Tuning, precision: str, samples: list[StepSample]) -> np.ndarray:
    c = OpContext(model, gpu, PrecisionPlan.named(precision, moe=model.is_moe), tuning)
    out = []
    for s in samples:
        w = s.work
        pc = w.prefill_attended / w.prefill_tokens if w.prefill_tokens else 1.0
        dc = w.decode_kv_tokens / w.decode_seqs if w.decode_seqs else 1.0
        rows = max(w.sampled - w.decode_seqs, 0)
        shape = StepShape(np.full(1, float(w.prefill_tokens)), np.full(1, pc), np.full(1, float(w.decode_seqs)),
                          np.full(1, dc), output_rows=np.full(1, float(rows)))
        out.append(float(step_time(c, Parallel.of(1, 1, 1, 1), shape).total[0]))
    return np.asarray(out)


def fit_engine(model_dir: str | Path, gpu: GpuSpec, samples: list[StepSample], precision: str = "bf16",
               rounds: int = 4) -> EngineFit:
    """Coordinate descent of the five fields on Σ log²(model / measured)."""
    model = get_model(str(model_dir))
    measured = np.array([s.seconds for s in samples])
    values = {**{f: getattr(gpu, f) for f in GPU_FIELDS}, **{f: getattr(Tuning(), f) for f in TUNING_FIELDS}}

    def loss(candidate: dict[str, float]) -> float:
        g = dataclasses.replace(gpu, **{f: candidate[f] for f in GPU_FIELDS})
        t = Tuning(**{f: candidate[f] for f in TUNING_FIELDS})
        return float(np.sum(np.log(_predict(model, g, t, precision, samples) / measured) ** 2))

    for _ in range(rounds):
        for name in (*GPU_FIELDS, *TUNING_FIELDS):
            low, high = BOUNDS[name]
            grid = np.unique(np.concatenate([np.geomspace(max(low, 1e-9), high, 24), values[name] * np.geomspace(0.5, 2, 9)]))
            grid = grid[(grid >= low) & (grid <= high)]
            values[name] = float(min(grid, key=lambda v: loss({**values, name: float(v)})))
    g = dataclasses.replace(gpu, **{f: values[f] for f in GPU_FIELDS})
    errors = np.abs(_predict(model, g, Tuning(**{f: values[f] for f in TUNING_FIELDS}), precision, samples) / measured - 1)
    return EngineFit({f: values[f] for f in GPU_FIELDS}, {f: values[f] for f in TUNING_FIELDS},
                     float(np.median(errors)), len(samples))


@dataclass(slots=True, frozen=True)
class LayoutPrediction:
    """The simulator's decode step for one of tokenmill's engine layouts on `cpu-local`."""
    layout: str  # the simulator's layout, e.g. "tp1 ep2 dp2"; "" when it has none
    step_s: float | None
    communication_s: float | None
    reason: str  # why there is no prediction, or what it assumes


def engine_layout(tp: int, ep: int, dp: int) -> Parallel | None:
    """The simulator's layout for an engine's --tp/--ep/--attention-dp (None: it has no such one).

    The engine's --ep alone runs attention whole on every rank for every token (replicated), which
    no serving engine does and the simulator does not model; with --attention-dp each rank's
    attention sees only its own requests (the simulator's dp), and with --tp both split heads."""
    if dp > 1:
        return Parallel.of(1, 1, ep, dp)
    if ep > 1 and tp == 1:
        return None
    return Parallel.of(tp, 1, ep, 1)


def predict_engine_decode_step(model_dir: str | Path, tp: int, ep: int, dp: int, batch: float,
                               context: float) -> LayoutPrediction:
    """The decode step of `batch` sequences of mean KV length `context` (spread over the
    attention-DP ranks) on the `cpu-local` entry, with the engine tuning `sim calibrate --model`
    fitted; no prediction without a calibration."""
    from tokenmill.sim.deploy import make_context

    par = engine_layout(tp, ep, dp)
    if par is None:
        return LayoutPrediction("", None, None, "--ep without --attention-dp replicates attention: not modelled")
    name = f"tp{tp} ep{ep} dp{dp}"
    try:
        c = make_context(str(model_dir), "cpu-local", "bf16")
    except ValueError as exc:  # no calibration on this machine
        return LayoutPrediction(name, None, None, str(exc))
    shape = StepShape(np.zeros(1), np.ones(1), np.full(1, batch / dp), np.full(1, context))
    t = step_time(c, par, shape)
    return LayoutPrediction(name, float(t.total[0]), float(t.communication[0]),
                            "cpu-local: this machine's calibration, one rank per simulated GPU")
