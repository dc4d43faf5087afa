"""Backend series (`name{labels} -> value`) as Prometheus families of their true type.

Workers and routers hand the frontend flat series. Exporting them all as gauges broke
Prometheus' `rate()` on counters and `histogram_quantile()` on histograms (whose buckets also
came out in string order). The type is read off the names, Prometheus' own conventions:

- `X_bucket{le=...}` with `X_sum` (and `X_count`) is a histogram `X`: buckets ordered by
  bound, cumulative as given, the count taken from the `+Inf` bucket;
- `X_total` is a counter `X`;
- anything else is a gauge.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

Series = tuple[str, dict[str, str], float]


@dataclass(slots=True)
class _Histogram:
    buckets: dict[str, float] = field(default_factory=dict)  # le -> cumulative count
    total: float = 0.0


def typed_families(series: Iterable[Series]) -> Iterator[Metric]:
    """One family per metric name; a family keeps only its first label set's label names."""
    series = list(series)
    histograms = {name[:-len("_bucket")] for name, labels, _ in series if name.endswith("_bucket") and "le" in labels}
    hist_values: dict[str, dict[tuple[tuple[str, str], ...], _Histogram]] = {}
    scalars: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, value in series:
        base = _histogram_base(name, histograms)
        if base is None:
            scalars.setdefault(name, []).append((labels, value))
            continue
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        hist = hist_values.setdefault(base, {}).setdefault(key, _Histogram())
        if name.endswith("_bucket"):
            hist.buckets[labels["le"]] = value
        elif name.endswith("_sum"):
            hist.total = value
    for base, by_labels in hist_values.items():
        yield _histogram_family(base, by_labels)
    for name, samples in scalars.items():
        yield _scalar_family(name, samples)


def _histogram_base(name: str, histograms: set[str]) -> str | None:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[:-len(suffix)] in histograms:
            return name[:-len(suffix)]
    return None


def _bound(le: str) -> float:
    return math.inf if le == "+Inf" else float(le)


def _histogram_family(base: str, by_labels: dict[tuple[tuple[str, str], ...], _Histogram]) -> Metric:
    label_names = [k for k, _ in next(iter(by_labels))]
    family = HistogramMetricFamily(base, f"backend histogram {base}", labels=label_names)
    for key, hist in by_labels.items():
        if [k for k, _ in key] != label_names:
            continue
        buckets = sorted(hist.buckets.items(), key=lambda item: _bound(item[0]))
        if not buckets or buckets[-1][0] != "+Inf":
            continue  # without +Inf it is no histogram Prometheus accepts
        family.add_metric([v for _, v in key], [[le, count] for le, count in buckets], hist.total)
    return family


def _scalar_family(name: str, samples: list[tuple[dict[str, str], float]]) -> Metric:
    label_names = sorted(samples[0][0])
    family: CounterMetricFamily | GaugeMetricFamily
    if name.endswith("_total"):
        family = CounterMetricFamily(name, f"backend counter {name}", labels=label_names)
    else:
        family = GaugeMetricFamily(name, f"backend gauge {name}", labels=label_names)
    for labels, value in samples:
        if sorted(labels) == label_names:  # one label set per family, as Prometheus requires
            family.add_metric([labels[k] for k in label_names], float(value))
    return family
