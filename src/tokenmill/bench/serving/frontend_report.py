"""Results of `tokenmill bench frontend`: one load run's figures, the targets, the table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.bench.serving.frontend_wrk import WrkResult


@dataclass(slots=True)
class LoadResult:
    requests: int  # responses wrk received, error statuses included
    ok_requests: int
    duration_s: float
    requests_per_s: float  # ok_requests / duration_s
    latency_ms_p50: float
    latency_ms_p90: float
    latency_ms_p99: float
    latency_ms_mean: float
    latency_ms_max: float
    errors: dict[str, int]  # wrk's kinds: connect, read, write, timeout, status (> 399)
    errors_total: int
    cpu_s_frontend: float
    cpu_s_workers: float
    cpu_s_per_1k_requests: float | None  # frontend + workers, per 1,000 ok requests
    frontend_share: float | None
    workers_share: float | None

    @classmethod
    def of(cls, wrk: WrkResult, cpu_frontend: float, cpu_workers: float) -> LoadResult:
        cpu = cpu_frontend + cpu_workers
        ok = wrk.ok_requests
        ms = {k: v / 1000 for k, v in wrk.latency_us.items()}
        return cls(wrk.requests, ok, wrk.duration_s, ok / wrk.duration_s if wrk.duration_s else 0.0,
                   ms["p50_us"], ms["p90_us"], ms["p99_us"], ms["mean_us"], ms["max_us"],
                   dict(wrk.errors), wrk.total_errors, cpu_frontend, cpu_workers,
                   cpu / ok * 1000 if ok else None,
                   cpu_frontend / cpu if cpu > 0 else None, cpu_workers / cpu if cpu > 0 else None)


@dataclass(slots=True, frozen=True)
class Target:
    path: tuple[str, ...]  # where the measured value sits in the report
    op: str  # ">=" or "<="
    limit: float
    unit: str

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value >= self.limit if self.op == ">=" else value <= self.limit

    def describe(self, value: float | None) -> str:
        verdict = {True: "met", False: "miss", None: "n/a"}[self.met(value)]
        return f"{self.op} {self.limit:,g}{self.unit} {verdict}"


# the project's targets, for reference only: nothing asserts them
TARGETS: dict[str, Target] = {
    "non_streaming_requests_per_s": Target(("runs", "non_streaming", "requests_per_s"), ">=", 2750, ""),
    "streaming_requests_per_s": Target(("runs", "streaming", "requests_per_s"), ">=", 1000, ""),
    "non_streaming_cpu_s_per_1k_requests": Target(("runs", "non_streaming", "cpu_s_per_1k_requests"), "<=", 0.6, ""),
    "streaming_cpu_s_per_1k_requests": Target(("runs", "streaming", "cpu_s_per_1k_requests"), "<=", 1.5, ""),
    "startup_s": Target(("startup", "first_200_s"), "<=", 1.5, " s"),
    "idle_rss_mib": Target(("idle_rss", "total_mib"), "<=", 600, " MiB"),
}


def _lookup(report: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = report
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def target_checks(report: dict[str, Any], targets: dict[str, Target]) -> dict[str, dict[str, Any]]:
    """{name: {op, target, value, met}} of each target against the report's measured value."""
    checks = {}
    for name, target in targets.items():
        value = _lookup(report, target.path)
        checks[name] = {"op": target.op, "target": target.limit, "value": value, "met": target.met(value)}
    return checks


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _table(report: dict[str, Any]) -> Table:
    cfg = report["config"]
    table = Table(title=f"bench frontend: {cfg['workers']} mock workers, wrk {cfg['connections']} connections "
                        f"x {cfg['threads']} threads, {cfg['duration']} s per run")
    for column in ("run", "req/s", "target", "p50 ms", "p99 ms", "errors", "CPU s/1k req", "target",
                   "frontend", "workers"):
        table.add_column(column, justify="left" if column == "run" else "right")
    labels = {"non_streaming": "non-streaming", "streaming": f"streaming {cfg['stream_tokens']} tokens"}
    for name, r in report["runs"].items():
        rps, cpu = TARGETS[f"{name}_requests_per_s"], TARGETS[f"{name}_cpu_s_per_1k_requests"]
        table.add_row(labels.get(name, name), f"{r['requests_per_s']:,.0f}", rps.describe(r["requests_per_s"]),
                      f"{r['latency_ms_p50']:.2f}", f"{r['latency_ms_p99']:.2f}", f"{r['errors_total']:,}",
                      _f(r["cpu_s_per_1k_requests"], ".3f"), cpu.describe(r["cpu_s_per_1k_requests"]),
                      _f(r["frontend_share"], ".0%"), _f(r["workers_share"], ".0%"))
    return table


def render(report: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)  # a log file gets each row on one line
    console.print(_table(report))
    startup, rss = report["startup"], report["idle_rss"]
    console.print(f"start-up: {startup['first_200_s']:.2f} s to the first 200 (all {report['config']['workers']} "
                  f"workers connected at {startup['all_workers_s']:.2f} s); target "
                  f"{TARGETS['startup_s'].describe(startup['first_200_s'])}")
    by_role: dict[str, list[str]] = {}
    for proc in rss["processes"]:
        by_role.setdefault(proc["role"], []).append(f"{proc['mib']:,.0f}")
    split = "; ".join(f"{role} {', '.join(sizes)}" for role, sizes in by_role.items())
    console.print(f"idle RSS: {rss['total_mib']:,.0f} MiB over {len(rss['processes'])} processes ({split}); "
                  f"target {TARGETS['idle_rss_mib'].describe(rss['total_mib'])}")
