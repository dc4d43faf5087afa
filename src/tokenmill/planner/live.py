"""The local connector: the planner against a running `tokenmill serve`, over its HTTP API (or,
with a `connector`, e.g. `KubernetesConnector`, workers listed and scaled by it instead, the
frontend's `/metrics` still the load).

Every interval: scrape `/metrics`, read `GET /admin/workers`, make the `Observation`, step the
planner, and carry out its actions with `POST /admin/workers` (`start` N of a role; `drain` N of
a role, newest first: a draining worker takes nothing new and finishes what it holds). A start
that fails shows up as a `failed` worker, which the next observation does not count, so the next
decision asks again: nothing waits on a replica that never became healthy.

With `fast_s`, between intervals it scrapes every `fast_s` seconds and hands the planner's fast
path that short window (its TTFT p90 from the frontend's histogram), which may add replicas at
once; the interval's own observation still spans the whole interval.

Where the serving pool's minimum is 0 (scale to zero), a watcher looks every `COLD_POLL_S`, and
at once when `wake` is called (the frontend in this process calls it as a request starts waiting
for a worker), for requests waiting while the pool has no replica, and hands them to the
planner's cold-start path. One lock keeps the paths from acting on each other's stale view.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.planner.decision import Decision
from tokenmill.planner.metrics import PlannerMetrics
from tokenmill.planner.observation import Observation
from tokenmill.planner.planner import Planner
from tokenmill.planner.prometheus_observer import WAITING_FOR_WORKER, observe, scrape

log = logging.getLogger(__name__)

COLD_POLL_S = 2.0  # a planner in another process sees a waiting request within this (no wake call reaches it)


@dataclass(slots=True)
class ActionOutcome:
    role: str
    delta: int
    status: int
    detail: Any


@dataclass(slots=True)
class LiveDeployment:
    planner: Planner
    client: httpx.AsyncClient  # base_url is the frontend; carries the admin key
    interval_s: float
    warmup_s: float = 60.0
    metrics: PlannerMetrics | None = None
    outcomes: list[ActionOutcome] = field(default_factory=list)
    paused: bool = False  # observes but neither decides nor acts (the dashboard's planner switch)
    connector: Any = None  # `workers()` and `scale(role, delta)` elsewhere than /admin/workers
    fast_s: float | None = None  # the fast path's period between intervals (None: no fast path)
    _last: dict[str, Any] | None = None
    _last_fast: dict[str, Any] | None = None
    _started: float = field(default_factory=time.monotonic)
    _woken: asyncio.Event = field(default_factory=asyncio.Event)
    _acting: asyncio.Lock = field(default_factory=asyncio.Lock)

    def wake(self) -> None:
        """A request is waiting for a worker: look now, not at the next poll."""
        self._woken.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Decide every interval until `stop` is set (the first scrape only sets the baseline),
        with `fast_s` check the fast path every `fast_s` between them, and where the pool may be
        empty watch for requests waiting on it."""
        watcher = asyncio.create_task(self._watch_empty_pool(stop)) if self.planner.may_scale_to_zero else None
        try:
            await self._plan(stop)
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)

    async def _plan(self, stop: asyncio.Event) -> None:
        self._last = self._last_fast = scrape(await self._text("/metrics"))
        if self.planner.may_scale_to_zero and WAITING_FOR_WORKER not in self._last:
            log.warning("planner: a pool may scale to zero, but the frontend holds no request for a worker "
                        "(start it with --scale-to-zero): requests to the empty pool will be refused")
        period = self.fast_s or self.interval_s
        next_interval = time.monotonic() + self.interval_s
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), period)
                return
            except TimeoutError:
                pass
            regular = time.monotonic() + period / 2 >= next_interval
            if regular:
                next_interval += self.interval_s
            try:
                if self.paused:  # resumed, it plans on fresh intervals
                    self._last = self._last_fast = scrape(await self._text("/metrics"))
                elif regular:
                    await self.tick()
                else:
                    await self.fast_tick()
            except httpx.HTTPError as exc:  # the frontend is away: hold, and try again next interval
                log.warning("planner: the deployment did not answer (%s); holding", exc)

    async def tick(self) -> Decision:
        async with self._acting:
            now = scrape(await self._text("/metrics"))
            obs = await self._observe(self._last or now, now, self.interval_s)
            self._last = self._last_fast = now
            decision = self.planner.step(obs)
            await self._act(decision)
            return decision

    async def fast_tick(self) -> Decision | None:
        """The fast path over the seconds since the last scrape; None when it did nothing."""
        async with self._acting:
            now = scrape(await self._text("/metrics"))
            obs = await self._observe(self._last_fast or now, now, self.fast_s or self.interval_s)
            self._last_fast = now
            decision = self.planner.fast_step(obs)
            if decision is not None:
                await self._act(decision)
            return decision

    async def cold_tick(self) -> Decision | None:
        """The cold-start path on the deployment as it is now; None when it did nothing."""
        async with self._acting:
            now = scrape(await self._text("/metrics"))
            decision = self.planner.cold_step(await self._observe(now, now, COLD_POLL_S))
            if decision is not None:
                await self._act(decision)
            return decision

    async def _watch_empty_pool(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(self._woken.wait(), COLD_POLL_S)
            except TimeoutError:
                pass
            self._woken.clear()
            if self.paused:
                continue
            try:
                await self.cold_tick()
            except httpx.HTTPError as exc:
                log.warning("planner: the deployment did not answer (%s); looking again", exc)
            except Exception:  # a bug here must not end the watch: requests would wait for the interval
                log.exception("planner: the cold-start path failed; looking again")

    async def _observe(self, before: dict[str, Any], after: dict[str, Any], window_s: float) -> Observation:
        workers = await self.workers()
        return observe(before, after, time.monotonic() - self._started, window_s, workers, self.warmup_s)

    async def _act(self, decision: Decision) -> None:
        if self.metrics is not None:
            self.metrics.record(decision)
        for action in decision.actions:
            await self._execute(action.role, action.delta)

    async def workers(self) -> list[dict[str, Any]]:
        if self.connector is not None:
            workers = await self.connector.workers()
        else:
            response = await self.client.get("/admin/workers")
            response.raise_for_status()
            workers = response.json().get("data", [])
        now = time.monotonic() - self._started
        for worker in workers:  # its age on this loop's clock, for the warm-up rule
            if isinstance(worker.get("started_at"), (int, float)):
                worker["serving_since"] = now - (time.time() - worker["started_at"])
        return workers

    async def _execute(self, role: str, delta: int) -> None:
        if self.connector is not None:
            outcome = await self.connector.scale(role, delta)
            self.outcomes.append(outcome)
            return
        body = {"action": "start" if delta > 0 else "drain", "role": role, "count": abs(delta)}
        response = await self.client.post("/admin/workers", json=body)
        detail = response.json() if response.headers.get("content-type", "").startswith("application/json") else None
        self.outcomes.append(ActionOutcome(role, delta, response.status_code, detail))
        if response.status_code >= 400:
            log.warning("planner: %s %d %s refused (%d): %s", body["action"], abs(delta), role,
                        response.status_code, detail)

    async def _text(self, path: str) -> str:
        response = await self.client.get(path)
        response.raise_for_status()
        return response.text
