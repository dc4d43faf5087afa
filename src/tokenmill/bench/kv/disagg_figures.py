"""The figures `tokenmill bench disagg` reports for a measured arm (`arm_json`: bench serve's
summary, per prompt class, and whether the rate was right) and for the pair (`comparison_json`:
disaggregated ÷ aggregated against the targets). The JSON layout is in `disagg_bench`'s docstring."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.bench.harness.serve_observe import CLIENT_KEY, FRONTEND_KEY, HOST_KEY
from tokenmill.bench.kv.disagg_workload import LONG, SHORT

if TYPE_CHECKING:
    from tokenmill.bench.harness.loadgen import RequestRecord
    from tokenmill.bench.harness.serve_stats import Distribution, ServeSummary

AGGREGATED, DISAGGREGATED = "aggregated", "disaggregated"
P99_ITL_TARGET_MAX = 0.5
OUTPUT_TPS_TARGET_MIN = 0.75
NON_WORKER_KEYS = (HOST_KEY, CLIENT_KEY, FRONTEND_KEY)


@dataclass(slots=True)
class ArmRun:
    name: str
    serve_flags: list[str]
    records: list[RequestRecord]
    cpu_s: dict[str, float]  # CPU seconds used during the measured run, per process (see cpu_snapshot)
    cpu_window_s: float  # wall seconds between the two CPU snapshots
    decisions: list[dict[str, Any]] | None
    server_events: dict[str, int] | None = None  # from the serve log, see count_server_events



def class_figures(records: Sequence[RequestRecord], classes: Sequence[str]) -> dict[str, dict[str, Any]]:
    from tokenmill.bench.harness.loadgen import OK
    from tokenmill.bench.harness.serve_stats import distribution_ms

    out = {}
    for cls in (LONG, SHORT):
        ok = [r for r in records if classes[r.index] == cls and r.status == OK]
        out[cls] = {"requests": sum(1 for c in classes if c == cls),
                    "ttft_ms": _dist_json(distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None])),
                    "itl_ms": _dist_json(distribution_ms([gap for r in ok for gap in r.itl_s]))}
    return out


def load_figures(arm: ArmRun, summary: ServeSummary, arrival_span_s: float,
                 classes: Sequence[str]) -> dict[str, Any]:
    """Is the rate right? Cores busy (CPU near 1 per worker) and a stable queue (trend near 1)."""
    duration = summary.duration_s
    busy = sum(r.e2e_s or 0.0 for r in arm.records if r.status == "ok")
    cores = {k: v / arm.cpu_window_s for k, v in arm.cpu_s.items() if arm.cpu_window_s > 0}
    ours = sum(v for k, v in cores.items() if k != HOST_KEY)
    return {"drain_s": duration - arrival_span_s, "mean_in_flight": busy / duration if duration > 0 else 0.0,
            "short_ttft_late_over_early": queue_trend(arm.records, classes),
            "worker_cpu_utilization": {k: v for k, v in cores.items() if k not in NON_WORKER_KEYS},
            "frontend_cpu_utilization": cores.get(FRONTEND_KEY), "client_cpu_utilization": cores.get(CLIENT_KEY),
            # CPU the rest of the box used meanwhile: well above 0 means the two cores were not ours
            "other_processes_cpu_cores": cores[HOST_KEY] - ours if HOST_KEY in cores else None,
            "server_events": arm.server_events}


def queue_trend(records: Sequence[RequestRecord], classes: Sequence[str]) -> float | None:
    """Median TTFT of the last third of short-prompt requests (by arrival) over the first third's.

    A short prompt's TTFT is mostly its wait for the engine, so a queue that grows through the run
    shows as a ratio well above 1; drain time alone cannot tell, as it includes the last answers.
    """
    ttfts = [r.ttft_s for r in sorted(records, key=lambda r: r.index)
             if classes[r.index] == SHORT and r.status == "ok" and r.ttft_s is not None]
    third = len(ttfts) // 3
    if third == 0:
        return None
    early, late = statistics.median(ttfts[:third]), statistics.median(ttfts[-third:])
    return late / early if early > 0 else None


def _dist_json(dist: Distribution | None) -> dict[str, float] | None:
    return None if dist is None else asdict(dist)


def arm_json(arm: ArmRun, classes: Sequence[str], arrival_span_s: float, save_requests: bool) -> dict[str, Any]:
    from tokenmill.bench.harness.serve_report import request_json
    from tokenmill.bench.harness.serve_stats import SLO, summarize

    summary = summarize(arm.records, SLO(), None)
    out: dict[str, Any] = {"serve_flags": arm.serve_flags, "results": asdict(summary),
                           "by_class": class_figures(arm.records, classes),
                           "load": load_figures(arm, summary, arrival_span_s, classes),
                           "disagg_decisions": arm.decisions}
    if save_requests:
        out["requests"] = [{**request_json(r), "class": classes[r.index]} for r in arm.records]
    return out


def comparison_json(arms: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    if AGGREGATED not in arms or DISAGGREGATED not in arms:
        return None
    agg, dis = arms[AGGREGATED]["results"], arms[DISAGGREGATED]["results"]
    itl_ratio = _ratio(_p99(dis["itl_ms"]), _p99(agg["itl_ms"]))
    tps_ratio = _ratio(dis["output_token_throughput"], agg["output_token_throughput"])
    return {"p99_itl_ratio": itl_ratio, "p99_itl_target_max": P99_ITL_TARGET_MAX,
            "p99_itl_met": itl_ratio is not None and itl_ratio <= P99_ITL_TARGET_MAX,
            "output_tokens_per_s_ratio": tps_ratio, "output_tokens_per_s_target_min": OUTPUT_TPS_TARGET_MIN,
            "output_tokens_per_s_met": tps_ratio is not None and tps_ratio >= OUTPUT_TPS_TARGET_MIN}


def _p99(dist: dict[str, float] | None) -> float | None:
    return None if dist is None else dist["p99"]


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0 or math.isnan(num):
        return None
    return num / den
