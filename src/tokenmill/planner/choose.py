"""`tokenmill planner choose`: which deployment shape and planner mode serve a load at the fewest
GPU-hours, decided by the planner's own runs in the fleet simulator, not by a flag to guess.

    tokenmill planner choose --trace code.csv --rate-scale 4 --model llama-3.1-70b --gpu h100 \\
        --precision fp8 --layout tp4 --ttft-ms 1000 --itl-ms 50 --attainment 0.9 --jobs 2

    candidates = candidates_from(args)       # each shape (agg; disagg at each threshold) x each mode
    runs = [run_candidate(c, args) ...]      # the planner sizing that deployment over the load
    choice = choose(runs, attainment=0.9)    # the cheapest run that reaches the attainment

Shapes, every pool on `--layout`:
- `agg`: one pool that prefills and decodes. A step that carries a prefill chunk beside the decode
  batch stalls every stream on that replica; on a load of long prompts and short outputs that is
  what misses the ITL target, and more replicas only thin it out.
- `disagg` at a threshold T: prompts with at least T uncached tokens prefill on a prefill pool and
  their KV moves to a decode pool; shorter ones prefill on their decode replica (T = 0: all remote).
  A larger T is the conditional deployment: less prefill capacity and KV traffic, some stall back.

The rule, a typed `Choice` carrying its reason: among the runs whose SLA attainment reaches
`--attainment`, the fewest GPU-hours (ties: the higher attainment); when none reaches it, the
highest attainment (ties: fewer GPU-hours), and the reason says so. Beside it, the load's
burstiness (`Burstiness`), and for each shape and mode that lost, what it would have cost or
missed, so a user sees when hybrid or load mode, or another shape, would have done better.
"""
from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tokenmill.planner.flags import MODES

SCHEMA = "tokenmill.planner.choose/1"
SHAPES = ("agg", "disagg")


@dataclass(slots=True, frozen=True)
class Candidate:
    shape: str  # "agg" or "disagg"
    mode: str  # the planner mode: sla, load or hybrid
    threshold: int | None = None  # disagg: uncached prompt tokens from which prefill goes remote

    def describe(self) -> str:
        shape = self.shape if self.threshold is None else f"{self.shape} (remote prefill from {self.threshold} tokens)"
        return f"{shape}, {self.mode}"


@dataclass(slots=True, frozen=True)
class CandidateRun:
    candidate: Candidate
    attainment: float
    gpu_hours: float
    ttft_miss_share: float
    itl_miss_share: float
    peak_replicas: int


@dataclass(slots=True, frozen=True)
class Burstiness:
    """How the load's arrivals spread over `interval_s` intervals (the full ones from t = 0, as the
    backtest buckets them): the coefficient of variation of the per-interval counts, the busiest
    interval over the mean one, and the share of empty ones."""
    interval_s: float
    cv: float
    peak_to_mean: float
    idle_share: float

    @classmethod
    def of(cls, arrivals_s: Sequence[float], interval_s: float) -> Burstiness:
        from tokenmill.planner.backtest import bucket_arrivals

        zeros = [0] * len(arrivals_s)
        counts = np.asarray(bucket_arrivals(arrivals_s, zeros, zeros, interval_s).requests)
        mean = float(counts.mean())
        if mean == 0:
            return cls(interval_s, 0.0, 0.0, 1.0)
        return cls(interval_s, float(counts.std() / mean), float(counts.max() / mean), float(np.mean(counts == 0)))

    def describe(self) -> str:
        return (f"per {self.interval_s:g} s: counts vary by {self.cv:.2f}x their mean (CV), the busiest interval "
                f"carries {self.peak_to_mean:.1f}x the mean, {self.idle_share:.0%} are empty")


@dataclass(slots=True, frozen=True)
class Choice:
    run: CandidateRun
    reached: bool  # whether the run reaches the attainment target
    reason: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.planner.simulate import add_arguments as simulate_arguments

    simulate_arguments(parser)
    g = parser.add_argument_group("choice")
    g.add_argument("--attainment", type=float, default=0.99,
                   help="the SLA attainment to reach; the cheapest candidate reaching it is chosen")
    g.add_argument("--shapes", default="agg,disagg", help=f"comma list of {', '.join(SHAPES)}")
    g.add_argument("--thresholds", default="256,2048",
                   help="disagg: the remote-prefill thresholds to try (uncached prompt tokens; 0: all remote)")
    g.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    g.add_argument("--jobs", type=int, default=1, help="candidates simulated at once (processes)")


def candidates_from(args: argparse.Namespace) -> list[Candidate]:
    """The candidates the flags ask for; ValueError naming the flag for a bad one."""
    if not 0.0 < args.attainment <= 1.0:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.plot is not None:
        raise ValueError("--plot: planner choose draws no plot (planner simulate does, for one candidate)")
    for role in ("agg", "prefill", "decode"):
        if getattr(args, role):
            raise ValueError(f"--{role}: planner choose sizes each shape itself (the shapes come from --shapes)")
    shapes = _members(args.shapes, SHAPES, "--shapes")
    modes = _members(args.modes, MODES, "--modes")
    thresholds: list[int | None] = []
    for text in (t for t in args.thresholds.split(",") if t.strip()):
        if not text.strip().isdigit():
            raise ValueError(f"--thresholds: each must be an integer >= 0, got {text!r}")
        thresholds.append(int(text))
    if "disagg" in shapes and not thresholds:
        raise ValueError("--thresholds: the disagg shape needs at least one threshold")
    out = []
    for shape in shapes:
        for threshold in ([None] if shape == "agg" else thresholds):
            out += [Candidate(shape, mode, threshold) for mode in modes]
    return out


def _members(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"{flag} must be a comma list of {', '.join(allowed)}, got {text!r}")
    return list(dict.fromkeys(items))


def candidate_args(candidate: Candidate, args: argparse.Namespace) -> argparse.Namespace:
    """The `planner simulate` flags of one candidate: the user's, with its shape and mode."""
    out = copy.copy(args)
    out.planner_mode = candidate.mode
    out.no_baselines = True
    out.agg = out.prefill = out.decode = 0
    if candidate.shape == "agg":
        out.agg = 1
    else:
        out.prefill = out.decode = 1
        out.prefill_layout = out.decode_layout = args.layout
        out.disagg_threshold = candidate.threshold
    return out


def run_candidate(candidate: Candidate, args: argparse.Namespace) -> CandidateRun:
    """The planner sizing the candidate's deployment over the load, as `planner simulate` runs it."""
    from tokenmill.planner.simulate import plan_over, summary

    totals = summary(plan_over(candidate_args(candidate, args))[2])
    return CandidateRun(candidate, float(totals["sla_attainment"]), float(totals["gpu_hours"]),
                        float(totals["ttft_miss_share"]), float(totals["itl_miss_share"]), int(totals["peak_replicas"]))


def choose(runs: Sequence[CandidateRun], attainment: float) -> Choice:
    """The fewest GPU-hours among the runs reaching `attainment`; else the highest attainment."""
    if not runs:
        raise ValueError("no candidate to choose from")
    reaching = [r for r in runs if r.attainment >= attainment - 1e-12]
    if reaching:
        best = min(reaching, key=lambda r: (r.gpu_hours, -r.attainment))
        why = (f"{best.candidate.describe()}: the fewest GPU-hours ({best.gpu_hours:.1f}) of the "
               f"{len(reaching)} candidate(s) reaching {attainment:.1%} attainment ({best.attainment:.2%})")
    else:
        best = max(runs, key=lambda r: (r.attainment, -r.gpu_hours))
        why = (f"no candidate reaches {attainment:.1%}; {best.candidate.describe()} comes closest "
               f"({best.attainment:.2%} at {best.gpu_hours:.1f} GPU-hours)")
    return Choice(best, bool(reaching), why)


def against(run: CandidateRun, chosen: CandidateRun) -> str:
    """What a candidate that lost would have cost or missed beside the chosen one, and why it missed."""
    cost = run.gpu_hours / max(chosen.gpu_hours, 1e-9)
    points = (run.attainment - chosen.attainment) * 100
    line = f"{points:+.1f} points at {cost:.2f}x the GPU-hours"
    if run.attainment < chosen.attainment and run.itl_miss_share > run.ttft_miss_share:
        line += f"; {run.itl_miss_share:.1%} of requests miss ITL"
        if run.candidate.shape == "agg":
            line += " (prefill chunks stall the streams of the replica that runs them)"
    elif run.attainment < chosen.attainment and run.ttft_miss_share > 0:
        line += f"; {run.ttft_miss_share:.1%} of requests miss TTFT"
    return line


def run_all(candidates: Sequence[Candidate], args: argparse.Namespace) -> list[CandidateRun]:
    if args.jobs == 1 or len(candidates) == 1:
        return [run_candidate(c, args) for c in candidates]
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(candidates))) as pool:
        return list(pool.map(run_candidate, candidates, [args] * len(candidates)))


def report(args: argparse.Namespace) -> dict[str, Any]:
    """Every candidate's run, the choice and the load's burstiness, as the command's JSON."""
    from tokenmill.planner.simulate import initial_config
    from tokenmill.sim.fleet.cli import check_outputs, load_requests

    candidates = candidates_from(args)
    check_outputs(args)  # a --json that cannot be written is refused before the runs, not after
    for candidate in {c.shape: c for c in candidates}.values():  # each shape's flags, before any run
        initial_config(candidate_args(candidate, args))
    requests = load_requests(args)
    burstiness = Burstiness.of([r.arrival_s for r in requests], args.planner_interval_s)
    runs = run_all(candidates, args)
    choice = choose(runs, args.attainment)
    return {"schema": SCHEMA, "attainment_target": args.attainment, "burstiness": asdict(burstiness),
            "burstiness_text": burstiness.describe(),
            "runs": [{**asdict(r), "vs_choice": None if r is choice.run else against(r, choice.run)} for r in runs],
            "choice": {**asdict(choice.run), "reached": choice.reached, "reason": choice.reason}}


def run(args: argparse.Namespace) -> int:
    from tokenmill.sim.fleet.cli import write_json_atomically

    try:
        out = report(args)
        if args.json_out:
            write_json_atomically(out, args.json_out)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}")
        return 2
    _print(out)
    return 0


def _print(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"planner choose: the cheapest at >= {out['attainment_target']:.1%} SLA attainment")
    for col in ("shape", "threshold", "mode", "attainment", "TTFT / ITL misses", "GPU-h", "peak replicas",
                "beside the choice"):
        table.add_column(col, justify="left" if col in ("shape", "mode", "beside the choice") else "right")
    for r in out["runs"]:
        c = r["candidate"]
        table.add_row(c["shape"], "" if c["threshold"] is None else str(c["threshold"]), c["mode"],
                      f"{r['attainment']:.2%}", f"{r['ttft_miss_share']:.2%} / {r['itl_miss_share']:.2%}",
                      f"{r['gpu_hours']:.1f}", str(r["peak_replicas"]), r["vs_choice"] or "chosen")
    console = Console(width=200)
    console.print(table)
    console.print(f"load: {out['burstiness_text']}")
    console.print(f"choice: {out['choice']['reason']}")
