"""A replica in the simulated fleet: a `SimWorker`, its clock, its lifecycle and its current step.

Lifecycle: `starting` (GPUs held, serving nothing) → `up` (routable) → `draining` (not routable,
finishing what it holds) → `gone`. GPU time counts from creation to gone.

Steps. A step's duration is the clock's price of its `StepWork`. A batch of decodes alone (nothing
waiting could be admitted) repeats itself until a sequence finishes or something arrives, so it is run as
one *decode run* of k identical steps (the KV length growing by one per sequence each step):
step i lasts d_i = f0 + (f1 − f0)·i/(k−1), f0 and f1 the prices of the first and last step (the
clock is multilinear, so this is its own interpolation along the run). Anything that changes the
replica's batch mid-run (a new request, a pulled KV) `truncate`s the run after the step in
progress, as the live engine admits new work only at a step boundary. Runs are what make a
day-long trace over a hundred GPUs replay in seconds; a run of k = 1 is an ordinary step.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.sim.fleet.clock import StepClock
from tokenmill.sim.fleet.worker import Batch, SimWorker
from tokenmill.step_work import StepWork

MAX_RUN_STEPS = 512  # bounds the linear-in-i error of a run whose context crosses grid points


@dataclass(slots=True)
class Run:
    batch: Batch
    t0: float
    steps: int
    f0: float  # seconds of the first step
    f1: float  # seconds of the last step

    def elapsed(self, steps: int) -> float:
        """Seconds from t0 to the end of step `steps` - 1 (closed form of Σ d_i)."""
        if self.steps == 1 or steps == 0:
            return steps * self.f0
        slope = (self.f1 - self.f0) / (self.steps - 1)
        return steps * self.f0 + slope * steps * (steps - 1) / 2.0

    @property
    def end(self) -> float:
        return self.t0 + self.elapsed(self.steps)

    def truncate(self, now: float) -> bool:
        """End the run after the step in progress at `now`; True if it got shorter."""
        done = 0
        while done < self.steps and self.t0 + self.elapsed(done + 1) <= now:
            done += 1
        keep = min(done + 1, self.steps)
        if keep == self.steps:
            return False
        slope = (self.f1 - self.f0) / (self.steps - 1)
        self.f1 = self.f0 + slope * (keep - 1)
        self.steps = keep
        return True


class Replica:
    def __init__(self, worker: SimWorker, clock: StepClock, created_s: float) -> None:
        self.worker = worker
        self.clock = clock
        self.state = "starting"
        self.created_s = created_s
        self.gone_s: float | None = None
        self.up_s: float | None = None  # when it started serving
        self.run: Run | None = None
        self.version = 0  # bumps whenever the pending step-end event is replaced
        self.busy_s = 0.0
        self.pending_imports = 0  # requests routed here whose KV is still on a prefill replica
        self.rerole_to: str | None = None

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    @property
    def role(self) -> str:
        return self.worker.role

    @property
    def gpus(self) -> int:
        return self.clock.profile.gpus

    def start_step(self, now: float) -> bool:
        """Schedule the next step (or decode run); False when there is nothing to run."""
        if self.run is not None or not self.worker.has_work():
            return False
        batch = self.worker.schedule()
        if not batch.chunks:
            return False
        steps = self.worker.plan_decode_run(batch, MAX_RUN_STEPS)
        work = batch.work()
        f0 = self.clock.seconds(work)
        f1 = f0 if steps == 1 else self.clock.seconds(_advanced(work, steps - 1))
        self.run = Run(batch, now, steps, f0, f1)
        self.version += 1
        return True

    def finish_step(self) -> Run:
        run, self.run = self.run, None
        if run is None:
            raise RuntimeError(f"{self.worker_id}: a step ended that never started")
        self.busy_s += run.elapsed(run.steps)
        return run

    def is_idle(self) -> bool:
        w = self.worker
        return (self.run is None and not w.has_work() and not w.held and not w.importing
                and not self.pending_imports)


def _advanced(work: StepWork, steps: int) -> StepWork:
    """The same decode batch `steps` steps later: every sequence's KV `steps` tokens longer."""
    return StepWork(work.prefill_tokens, work.prefill_attended, work.prefill_kv_tokens, work.decode_seqs,
                    work.decode_kv_tokens + steps * work.decode_seqs, work.sampled)
