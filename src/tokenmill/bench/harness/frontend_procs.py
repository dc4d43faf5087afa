"""The serving processes of a `tokenmill serve`, from /proc: who they are, their memory, their CPU.

The supervisor starts each worker with `start_new_session=True`, so the serve process group
does not contain the workers; they are found as descendants of the serve pid (walking every
process's ppid) and, in case one was re-parented, by the pids in the workers' registry.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from tokenmill.bench.harness.serve_observe import cpu_seconds, descendants, parent_map

log = logging.getLogger(__name__)

FRONTEND, WORKER = "frontend", "worker"
ROLES = (FRONTEND, WORKER)


def classify(frontend_pid: int, worker_pids: Iterable[int]) -> dict[int, str]:
    """pid → role of every live serving process: the workers (registered pids and their
    descendants) and the frontend (serve itself and anything else it started, such as
    extra API-server processes)."""
    parents = parent_map()
    roles = {pid: FRONTEND for pid in {frontend_pid, *descendants(frontend_pid, parents)} if pid in parents}
    for worker in worker_pids:
        if worker in parents:
            roles.update((pid, WORKER) for pid in {worker, *descendants(worker, parents)})
    return roles


def rss_kib(pid: int) -> int | None:
    """Resident set size (VmRSS) in KiB; None once the process is gone or has no memory (a zombie)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return None


def cpu_snapshot(pids: Iterable[int]) -> dict[int, float]:
    """User + system CPU seconds so far of each pid still alive."""
    snapshot = {}
    for pid in pids:
        seconds = cpu_seconds(pid)
        if seconds is not None:
            snapshot[pid] = seconds
    return snapshot


def cpu_by_role(before: Mapping[int, float], after: Mapping[int, float], roles: Mapping[int, str]) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots; a process that started in between counts
    from zero, one that exited in between is lost (and logged: the figure is then an undercount)."""
    totals = dict.fromkeys(ROLES, 0.0)
    for pid, seconds in after.items():
        totals[roles.get(pid, FRONTEND)] += seconds - before.get(pid, 0.0)
    gone = sorted(set(before) - set(after))
    if gone:
        log.warning("serving processes %s exited during the run: their CPU time is not counted", gone)
    return totals
