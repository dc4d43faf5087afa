"""`tokenmill bench demo`'s outputs: the table, a PNG of each scenario's figures by state, and
(with `--mock`) the fleet simulator's prediction of each run: the same token ids, arrivals and
output lengths replayed over simulated replicas of the mock profile, laid out and routed as the
live workers were in that state."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.workloads.prompt_synth import RequestSpec


def print_table(rows: list[dict[str, Any]], mock: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bench demo: each scenario under each state of the dashboard's toggles")
    columns = ["scenario", "state", "requests", "failed", "TTFT mean ms", "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms",
               "ITL p99 ms", "hits device/host", "$/M out tok"]
    if mock:
        columns += ["sim TTFT mean ms", "sim TTFT p90 ms", "ITL/req p99 ms (live / sim)"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("scenario", "state") else "right")
    for row in rows:
        hits = row["hit_rate"] or {}
        cells = [row["scenario"], row["state"], str(row["requests"]), str(row["failed"]), _num(row["ttft_mean_ms"]),
                 _num(row["ttft_p50_ms"]), _num(row["ttft_p90_ms"]), _num(row["itl_p50_ms"], 1),
                 _num(row["itl_p99_ms"], 1), f"{hits.get('device', 0):.0%} / {hits.get('host', 0):.0%}",
                 _num(row["usd_per_million_output_tokens"], 2)]
        if mock:
            sim = row["simulated"]
            cells += [_num(sim["ttft_mean_ms"]), _num(sim["ttft_p90_ms"]),
                      f"{_num(row['itl_mean_p99_ms'], 1)} / {_num(sim['itl_mean_p99_ms'], 1)}"]
        table.add_row(*cells)
    Console().print(table)


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def write_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """One column per scenario: TTFT mean and p90, ITL p50 and p99, prefix hits by tier, cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    panels = (("TTFT (ms)", ("ttft_mean_ms", "ttft_p90_ms")), ("ITL (ms)", ("itl_p50_ms", "itl_p99_ms")),
              ("prefix hits (% of prompt tokens)", ("device", "host")), ("$ per M output tokens",
                                                                          ("usd_per_million_output_tokens",)))
    fig, axes = plt.subplots(len(panels), len(scenarios), figsize=(6 * len(scenarios), 11), squeeze=False)
    for col, scenario in enumerate(scenarios):
        mine = [r for r in rows if r["scenario"] == scenario]
        labels = [r["state"] for r in mine]
        for row_index, (title, keys) in enumerate(panels):
            ax = axes[row_index][col]
            width = 0.8 / len(keys)
            for k, key in enumerate(keys):
                values = [_value(r, key) for r in mine]
                ax.bar(np.arange(len(mine)) + k * width, values, width, label=key.replace("_", " "))
            ax.set_xticks(np.arange(len(mine)) + width * (len(keys) - 1) / 2, labels, fontsize=8)
            ax.set_title(f"{scenario}: {title}", fontsize=10)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _value(row: dict[str, Any], key: str) -> float:
    if key in ("device", "host"):
        return 100 * (row["hit_rate"] or {}).get(key, 0.0)
    return row[key] if row[key] is not None else 0.0


def simulate_run(warmup: list[RequestSpec], specs: list[RequestSpec], warmup_s: float, state: str,
                 args: argparse.Namespace) -> dict[str, Any]:
    """The fleet simulator's TTFT and per-request ITL for the run `specs` made in `state` after
    `warmup` (sent at once, `warmup_s` before the run, and not counted), in the live run's
    (wall-clock) seconds: modelled time divided by --mock-speedup."""
    from tokenmill.engine.config import EngineConfig
    from tokenmill.kv.hashing import block_hashes
    from tokenmill.sim.fleet.arrivals import TraceRequest
    from tokenmill.sim.fleet.clock import parse_profile
    from tokenmill.sim.fleet.config import FleetConfig
    from tokenmill.sim.fleet.fleet import FleetSim

    profile = parse_profile(args.mock, "--mock")
    split = state != "everything off"
    engine = EngineConfig(model=args.model)  # the mock workers' scheduling limits
    config = FleetConfig(profiles={"agg": profile, "prefill": profile, "decode": profile},
                         agg=0 if split else args.workers, prefill=args.workers // 2 if split else 0,
                         decode=args.workers - args.workers // 2 if split else 0,
                         router="kv" if "KV routing" in state else "round-robin", block_size=engine.block_size,
                         max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                         kv_blocks=args.kv_cache_blocks)
    arrivals = [0.0] * len(warmup) + [warmup_s + (s.arrival_s or 0.0) for s in specs]
    requests = [TraceRequest(f"r{i}", at * args.mock_speedup, len(s.prompt), s.output_len,
                             tuple(block_hashes(s.prompt, engine.block_size, engine.hash_seed)))
                for i, (at, s) in enumerate(zip(arrivals, [*warmup, *specs]))]
    sim = FleetSim(config)
    sim.run(requests)
    measured = {f"r{i}" for i in range(len(warmup), len(requests))}
    records = [r for r in sim.records.values() if r.finished and r.request_id in measured]
    ttft = np.array([r.ttft_s for r in records if r.ttft_s is not None]) * 1e3 / args.mock_speedup
    itl = np.array([r.itl_mean_s for r in records if r.itl_mean_s is not None]) * 1e3 / args.mock_speedup
    return {"requests": len(measured), "finished": len(records),
            "ttft_mean_ms": float(ttft.mean()) if len(ttft) else None,
            "ttft_p90_ms": float(np.percentile(ttft, 90)) if len(ttft) else None,
            "itl_mean_p50_ms": float(np.percentile(itl, 50)) if len(itl) else None,
            "itl_mean_p99_ms": float(np.percentile(itl, 99)) if len(itl) else None}
