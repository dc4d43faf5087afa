"""What `tokenmill bench disagg` observes of a running deployment besides its responses: CPU
seconds per process from /proc (the box may be shared, so the report says what else ran), the
disaggregation decision counters from /metrics, and worker drops and migrations from the serve
log (no counter exports those)."""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

    from tokenmill.bench.harness.serve_process import ServeProcess

log = logging.getLogger(__name__)

WORKER_DROP_RE = re.compile(r"WARNING \S+: worker \S+ left \(")  # fleet.worker_pool's drop warning
MIGRATION_TEXT = "migrating a request off worker"  # fleet.distributed_backend's warning
DECISIONS_RE = re.compile(r'^tokenmill_disagg_decisions_total\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)')
LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
HOST_KEY, CLIENT_KEY, FRONTEND_KEY = "host", "client", "frontend"  # non-worker keys of a CPU snapshot


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process, from /proc (None elsewhere or once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is the state (field 3 of stat); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parent_map() -> dict[int, int]:
    """pid → ppid of every live process."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the command name in parentheses may hold spaces or ')': split after the last one
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we read it
    return parents


def descendants(root: int, parents: Mapping[int, int] | None = None) -> set[int]:
    """Every live process below `root`: children, their children, … whatever their session."""
    parents = parent_map() if parents is None else parents
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def host_busy_seconds() -> float | None:
    """CPU seconds the whole host has spent busy (all cores, every process), from /proc/stat."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    guest = sum(ticks[8:10])  # guest time is already counted in user/nice
    return (sum(ticks) - idle - guest) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(server: ServeProcess) -> dict[str, float | None]:
    """CPU seconds so far of each worker ("id (role)", with its child processes), the frontend, this
    load generator ("client") and the whole host ("host"): the box is shared, so the report says
    what else ran."""
    snap: dict[str, float | None] = {HOST_KEY: host_busy_seconds(), CLIENT_KEY: cpu_seconds(os.getpid()),
                                     FRONTEND_KEY: cpu_seconds(server.process.pid)}
    parents = parent_map()
    for info in server.registry():
        pid = int(info["pid"])
        seconds = [cpu_seconds(p) for p in (pid, *descendants(pid, parents))]
        key = f"{info.get('worker_id', pid)} ({info.get('role', '?')})"
        snap[key] = None if seconds[0] is None else sum(s for s in seconds if s is not None)
    return snap


def parse_decisions(metrics_text: str) -> dict[tuple[str, str], float]:
    """(decision, reason) → count from Prometheus text; empty when the counter is not exported."""
    counts: dict[tuple[str, str], float] = {}
    for line in metrics_text.splitlines():
        match = DECISIONS_RE.match(line)
        if match is None:
            continue
        labels = dict(LABEL_RE.findall(match["labels"]))
        key = (labels.get("decision", ""), labels.get("reason", ""))
        counts[key] = counts.get(key, 0.0) + float(match["value"])
    return counts


async def fetch_decisions(client: httpx.AsyncClient, url: str) -> dict[tuple[str, str], float] | None:
    """The decision counters now; None when /metrics does not answer or has none."""
    import httpx

    try:
        resp = await client.get(f"{url}/metrics", timeout=10.0)
    except httpx.HTTPError as exc:
        log.warning("GET /metrics failed: %s", exc)
        return None
    counts = parse_decisions(resp.text) if resp.status_code == 200 else {}
    return counts or None


def decisions_delta(before: dict[tuple[str, str], float] | None,
                    after: dict[tuple[str, str], float] | None) -> list[dict[str, Any]] | None:
    """What the measured run added (the warm-up's decisions are left out)."""
    if after is None:
        return None
    before = before or {}
    return [{"decision": decision, "reason": reason, "count": int(round(value - before.get((decision, reason), 0)))}
            for (decision, reason), value in sorted(after.items())]


def count_server_events(log_path: Path) -> dict[str, int] | None:
    """Workers the frontend dropped (deregistered, heartbeat timeout, restarted) and the streams it
    migrated, warm-up included, from the serve log's warnings: no counter exports them, and a drop
    makes the other worker recompute the migrated prompts, which inflates that arm's latencies."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return {"worker_drops": len(WORKER_DROP_RE.findall(text)), "migrations": text.count(MIGRATION_TEXT)}
