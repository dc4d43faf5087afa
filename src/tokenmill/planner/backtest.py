"""`tokenmill planner backtest`: the load predictors one step ahead on a request trace.

The trace's arrivals are bucketed into intervals of `--interval-s`: per interval the number
of requests arriving in it, and the mean input (ISL) and output (OSL) tokens of those
requests. Each predictor is warm-started on the first `--warmup` intervals, then walks the
rest as the planner would: predict the next interval, then observe its truth. The score is the
MAPE (mean absolute percentage error) per series; an interval whose truth is 0 (no request:
the count is 0 and the means are undefined) has no percentage error and is skipped, and the
table says how many were. The trailing partial interval is dropped: its count would read as a
fall in load that never happened.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenmill.planner.predict import PREDICTORS, Predictor, make_predictor

log = logging.getLogger(__name__)

TRACE_NAMES = ("mooncake", "azure-conv", "azure-code")


@dataclass(slots=True)
class Buckets:
    interval_s: float
    requests: list[float]        # requests arriving in each interval
    isl: list[float | None]      # their mean input tokens (None: no request arrived)
    osl: list[float | None]      # their mean output tokens
    dropped: int                 # requests in the trailing partial interval, left out


@dataclass(slots=True)
class SeriesScore:
    mape: float | None   # percent; None when no interval could be scored
    wape: float | None   # sum |error| / sum truth, percent: not dominated by near-empty intervals
    scored: int
    skipped: int         # intervals whose truth was 0 or undefined


@dataclass(slots=True)
class PredictorScore:
    predictor: str
    requests: SeriesScore
    isl: SeriesScore
    osl: SeriesScore
    ms_per_observation: float  # predict + observe, averaged over the three series' steps


def bucket_arrivals(arrivals_s: Sequence[float], input_tokens: Sequence[int],
                    output_tokens: Sequence[int], interval_s: float) -> Buckets:
    """Requests per full interval from t=0, with their mean ISL and OSL."""
    import numpy as np

    if interval_s <= 0:
        raise ValueError(f"--interval-s must be > 0, got {interval_s}")
    arrival = np.asarray(arrivals_s, dtype=float)
    index = np.floor(arrival / interval_s).astype(np.int64)
    full = int(arrival.max() // interval_s) if arrival.size else 0
    if full < 1:
        raise ValueError(f"--interval-s {interval_s:g}: the trace spans less than one interval")
    keep = index < full
    counts = np.bincount(index[keep], minlength=full)
    isl_sum = np.bincount(index[keep], weights=np.asarray(input_tokens, dtype=float)[keep], minlength=full)
    osl_sum = np.bincount(index[keep], weights=np.asarray(output_tokens, dtype=float)[keep], minlength=full)
    return Buckets(interval_s, [float(c) for c in counts], _means(isl_sum, counts), _means(osl_sum, counts),
                   int((~keep).sum()))


def _means(sums: Any, counts: Any) -> list[float | None]:
    return [float(s) / int(c) if c else None for s, c in zip(sums, counts)]


def score_series(predictor: Predictor, series: Sequence[float | None], warmup: int) -> tuple[SeriesScore, float, int]:
    """One step ahead over `series[warmup:]`: (score, seconds spent in predict+observe, steps)."""
    predictor.warm_start([v for v in series[:warmup] if v is not None])
    errors: list[float] = []
    absolute, total = 0.0, 0.0
    skipped, steps, spent = 0, 0, 0.0
    for truth in series[warmup:]:
        start = time.perf_counter()
        forecast = predictor.predict()
        if truth is not None:
            predictor.observe(truth)  # an empty interval's means are unknown: nothing to learn
            steps += 1
        spent += time.perf_counter() - start
        if truth:
            errors.append(abs(forecast - truth) / truth)
            absolute, total = absolute + abs(forecast - truth), total + truth
        else:
            skipped += 1
    mape = 100.0 * sum(errors) / len(errors) if errors else None
    wape = 100.0 * absolute / total if total else None
    return SeriesScore(mape, wape, len(errors), skipped), spent, steps


def backtest(buckets: Buckets, predictors: Sequence[str], warmup: int,
             options: dict[str, dict[str, Any]] | None = None) -> list[PredictorScore]:
    """Each named predictor (with `options[name]` as its keywords) scored on the three series."""
    if warmup < 0 or warmup >= len(buckets.requests):
        raise ValueError(f"--warmup {warmup}: must be >= 0 and below the {len(buckets.requests)} intervals")
    scores = []
    for name in predictors:
        kwargs = (options or {}).get(name, {})
        parts = [score_series(make_predictor(name, **kwargs), series, warmup)
                 for series in (buckets.requests, buckets.isl, buckets.osl)]
        spent = sum(p[1] for p in parts)
        steps = sum(p[2] for p in parts)
        scores.append(PredictorScore(name, parts[0][0], parts[1][0], parts[2][0],
                                     1000.0 * spent / steps if steps else 0.0))
        log.info("backtest: %s done in %.2f s", name, spent)
    return scores


# ---------------------------------------------------------------------------------------------
# The command


def _predictor_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PREDICTORS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(PREDICTORS)} (comma-separated)")
    return names


def _number(kind: type, low: float, strict: bool):
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {'>' if strict else '>='} {low:g}")
        return value
    return parse


def _order(text: str) -> tuple[int, ...]:
    try:
        order = tuple(int(part) for part in text.split(","))
    except ValueError:
        order = ()
    if len(order) != 3 or min(order) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected P,D,Q (three integers >= 0)")
    return order


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True,
                        help=f"a Mooncake JSONL or Azure CSV file, or a shipped trace: {', '.join(TRACE_NAMES)}")
    parser.add_argument("--interval-s", type=_number(float, 0, True), default=30.0, help="planner interval (s)")
    parser.add_argument("--predictors", type=_predictor_list, default=list(PREDICTORS),
                        help=f"comma-separated, from {','.join(PREDICTORS)} (default: all)")
    parser.add_argument("--warmup", type=_number(int, 0, False), default=10,
                        help="intervals fed as history before scoring starts")
    parser.add_argument("--rate-scale", type=_number(float, 0, True), default=1.0,
                        help="superpose K time-shifted copies of the trace (load_trace's rate_scale)")
    parser.add_argument("--ma-window", type=_number(int, 1, False), default=4, help="moving_average window")
    parser.add_argument("--arima-order", type=_order, default=(1, 1, 1), help="arima P,D,Q")
    parser.add_argument("--json", dest="json_out", type=Path, default=None, help="write the results here")


def resolve_trace(text: str) -> Path:
    """A shipped trace's path by name, or `text` as a path."""
    from tokenmill.datasets import AZURE_CODE_TRACE, AZURE_CONV_TRACE, MOONCAKE_TRACE, data_file

    shipped = {"mooncake": MOONCAKE_TRACE, "azure-conv": AZURE_CONV_TRACE, "azure-code": AZURE_CODE_TRACE}
    if text in shipped:
        return data_file(shipped[text])
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(f"--trace {text}: no such file (or give one of {', '.join(TRACE_NAMES)})")
    return path


def run(args: argparse.Namespace) -> int:
    try:
        report = _run(args)
    except ValueError as exc:
        print(f"tokenmill planner backtest: error: {exc}", file=sys.stderr)
        return 2
    _print_table(report)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        log.info("wrote %s", args.json_out)
    return 0


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.sim.fleet.arrivals import load_trace

    path = resolve_trace(args.trace)
    rows = load_trace(path, rate_scale=args.rate_scale)
    buckets = bucket_arrivals([r.arrival_s for r in rows], [r.input_tokens for r in rows],
                              [r.output_tokens for r in rows], args.interval_s)
    options = {"moving_average": {"window": args.ma_window}, "arima": {"order": args.arima_order}}
    scores = backtest(buckets, args.predictors, args.warmup, options)
    return {"trace": str(path), "interval_s": args.interval_s, "rate_scale": args.rate_scale,
            "requests": len(rows), "dropped_requests": buckets.dropped, "intervals": len(buckets.requests),
            "warmup": args.warmup, "ma_window": args.ma_window, "arima_order": list(args.arima_order),
            "series": {"requests": buckets.requests, "isl": buckets.isl, "osl": buckets.osl},
            "scores": [asdict(s) for s in scores]}


def _print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    scored = report["intervals"] - report["warmup"]
    table = Table(title=f"predictor backtest: {Path(report['trace']).name} x{report['rate_scale']:g}, "
                        f"{report['intervals']} intervals of {report['interval_s']:g} s, {scored} scored "
                        f"after a warm-up of {report['warmup']}")
    table.add_column("predictor", no_wrap=True)
    for column in ("requests MAPE %", "ISL MAPE %", "OSL MAPE %", "skipped", "ms/obs"):
        table.add_column(column, justify="right")
    for score in report["scores"]:
        series = [score[key] for key in ("requests", "isl", "osl")]
        cells = ["-" if s["mape"] is None else f"{s['mape']:.2f}" for s in series]
        skipped = "/".join(str(s["skipped"]) for s in series)
        table.add_row(score["predictor"], *cells, skipped, f"{score['ms_per_observation']:.2f}")
    Console().print(table)
    print("skipped: intervals with no request (requests/ISL/OSL), left out of the MAPE; "
          "ms/obs: predict + observe, per observation")
