"""One measured start of a fresh `tokenmill frontend` for `tokenmill bench router-warmup`.

From just before its Popen, the frontend's /metrics is read every `poll_s`; once it says every
worker is connected, probes follow every `probe_interval_s`, one at a time, each the first
`prefix_blocks` blocks of a different fill prompt (so of one known holder, round-robin over
the workers; never one probed before) plus a fresh tail of two and a half blocks, with one
output token. The tail's new blocks are what real requests add too: a probe that only hit the
cache would make its worker publish no KV event, and in cold mode (no join snapshot) a worker
is snapshotted only when its first event after the join shows the frontend a gap in event ids.

A probe is *KV-aware* when both hold: its routing decision found the prefix in the index
(the one new sample of `tokenmill_router_overlap_blocks` — probes are the frontend's only
traffic — is above 0), and the worker that served it had the whole prefix cached
(`usage.prompt_tokens_details.cached_tokens` = the prefix's tokens), i.e. it went to the holder.
A probe sent to the holder by chance (a tie broken at random on an empty index) has overlap 0.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.bench.harness.frontend_procs import rss_kib
from tokenmill.bench.routing.router_warmup_fleet import BLOCK_SIZE, FIRST_TOKEN, FillPlan

log = logging.getLogger(__name__)

INDEX_FRACTION = 0.99
TAIL_TOKENS = 2 * BLOCK_SIZE + BLOCK_SIZE // 2
STOP_GRACE_S = 10.0
HTTP_TIMEOUT_S = 30.0


@dataclass(slots=True)
class ProbeSettings:
    url: str
    served_name: str
    workers: int
    prefix_blocks: int
    window_s: float
    probe_interval_s: float
    poll_s: float
    timeout_s: float


@dataclass(slots=True)
class Scrape:
    workers: float
    index_blocks: float
    decisions: float  # samples of the overlap histogram: one per routing decision
    blind: float  # of those, decisions with overlap 0


@dataclass(slots=True)
class ProbeSource:
    """Fresh cached prefixes, round-robin over their holders, newest prompts first."""
    plan: FillPlan
    prefix_blocks: int
    taken: int = 0

    def take(self) -> list[int] | None:
        worker, index = self.taken % self.plan.workers, self.plan.prompts_per_worker - 1 - self.taken // self.plan.workers
        if index < 0:
            return None
        tail = np.random.default_rng([self.plan.seed, 1 << 30, self.taken]).integers(
            FIRST_TOKEN, self.plan.vocab_size, TAIL_TOKENS).tolist()
        self.taken += 1
        return self.plan.prompt(worker, index)[:self.prefix_blocks * BLOCK_SIZE] + tail


@dataclass(slots=True)
class WarmupRun:
    mode: str
    repeat: int
    truth_blocks: int  # what the workers' own snapshots held just before the start
    http_up_s: float | None = None
    workers_joined_s: float | None = None
    index_99_s: float | None = None
    index_at_first_probe: int | None = None
    first_probe_latency_s: float | None = None  # long when it waits behind snapshots being applied
    first_kv_probe_s: float | None = None  # when its response arrived
    probes_before_kv: int | None = None
    window_probes: int = 0
    window_kv_probes: int = 0
    probes: int = 0
    probes_failed: int = 0
    final_index_blocks: int = 0
    frontend_rss_mib: float | None = None
    window_start_s: float | None = field(default=None, repr=False)


def scrape(client: httpx.Client, url: str) -> Scrape | None:
    try:
        reply = client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            key = sample.name + ("_le0" if sample.labels.get("le") == "0" else "")
            values[key] = values.get(key, 0.0) + sample.value
    return Scrape(values.get("tokenmill_workers", 0.0), values.get("tokenmill_router_index_blocks", 0.0),
                  values.get("tokenmill_router_overlap_blocks_count", 0.0),
                  values.get("tokenmill_router_overlap_blocks_bucket_le0", 0.0))


def _send(client: httpx.Client, settings: ProbeSettings, prompt: list[int]) -> int | None:
    """Cached tokens the serving worker reports, or None when the probe failed."""
    body = {"model": settings.served_name, "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
    try:
        reply = client.post(f"{settings.url}/v1/completions", json=body)
    except httpx.HTTPError as exc:
        log.debug("probe failed: %s", exc)
        return None
    if reply.status_code != 200:
        log.debug("probe answered %d: %s", reply.status_code, reply.text[:200])
        return None
    usage = reply.json().get("usage") or {}
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _probe(client: httpx.Client, settings: ProbeSettings, prompt: list[int], before: Scrape,
           run: WarmupRun, t0: float) -> Scrape | None:
    sent_s = time.monotonic() - t0
    cached = _send(client, settings, prompt)
    done_s = time.monotonic() - t0
    after = scrape(client, settings.url)
    one_decision = after is not None and after.decisions - before.decisions == 1
    overlap = one_decision and (after.decisions - after.blind) - (before.decisions - before.blind) == 1
    kv_aware = cached is not None and overlap and cached == settings.prefix_blocks * BLOCK_SIZE
    if run.probes == 0:
        run.index_at_first_probe, run.window_start_s = int(before.index_blocks), sent_s
        run.first_probe_latency_s = done_s - sent_s
    run.probes += 1
    run.probes_failed += cached is None
    if sent_s < run.window_start_s + settings.window_s:  # type: ignore[operator]
        run.window_probes += 1
        run.window_kv_probes += kv_aware
    if kv_aware and run.first_kv_probe_s is None:
        run.first_kv_probe_s, run.probes_before_kv = done_s, run.probes - 1
    return after


def _note(run: WarmupRun, at_s: float, seen: Scrape, workers: int) -> None:
    run.http_up_s = at_s if run.http_up_s is None else run.http_up_s
    if run.workers_joined_s is None and seen.workers >= workers:
        run.workers_joined_s = at_s
    if run.index_99_s is None and seen.index_blocks >= INDEX_FRACTION * run.truth_blocks:
        run.index_99_s = at_s
    run.final_index_blocks = int(seen.index_blocks)


def _finished(run: WarmupRun, settings: ProbeSettings, at_s: float, exhausted: bool) -> bool:
    if run.index_99_s is None:
        return False
    window_over = run.window_start_s is not None and at_s >= run.window_start_s + settings.window_s
    return exhausted or (run.first_kv_probe_s is not None and window_over)


def observe(process: subprocess.Popen, t0: float, settings: ProbeSettings, source: ProbeSource,
            run: WarmupRun) -> WarmupRun:
    """Scrape and probe the frontend until the run is finished or `timeout_s` has passed."""
    last: Scrape | None = None
    next_probe_s, exhausted = 0.0, False
    with httpx.Client(trust_env=False, timeout=HTTP_TIMEOUT_S) as client:
        while (now := time.monotonic() - t0) < settings.timeout_s:
            if process.poll() is not None:
                raise RuntimeError(f"the measured frontend exited with {process.returncode}")
            seen: Scrape | None = None
            if last is not None and run.workers_joined_s is not None and not exhausted and now >= next_probe_s:
                prompt = source.take()
                exhausted = prompt is None
                if prompt is not None:
                    seen, next_probe_s = _probe(client, settings, prompt, last, run, t0), now + settings.probe_interval_s
            seen = seen or scrape(client, settings.url)
            if seen is not None:
                _note(run, time.monotonic() - t0, seen, settings.workers)
                last = seen
            if _finished(run, settings, time.monotonic() - t0, exhausted):
                break
            time.sleep(settings.poll_s)
    if exhausted:
        log.warning("%s run %d: every fill prompt was probed; raise --blocks or lower --probe-window-s",
                    run.mode, run.repeat)
    rss = rss_kib(process.pid)
    run.frontend_rss_mib = None if rss is None else rss / 1024
    return run


def start_frontend(argv: Sequence[str], log_path: Path) -> tuple[subprocess.Popen, float]:
    """The process and the monotonic time just before it was started."""
    with open(log_path, "ab") as out:
        t0 = time.monotonic()
        process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return process, t0


def stop_frontend(process: subprocess.Popen) -> None:
    """SIGTERM by pid, SIGKILL after a grace period; reaped either way."""
    if process.poll() is not None:
        return
    os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        log.warning("frontend %d ignored SIGTERM for %.0f s: killing it", process.pid, STOP_GRACE_S)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
