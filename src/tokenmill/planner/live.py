"""The local connector: the planner against a running `tokenmill serve`, over its HTTP API (or,
with a `connector`, e.g. `KubernetesConnector`, workers listed and scaled by it instead, the
frontend's `/metrics` still the load).

Every interval: scrape `/metrics`, read `GET /admin/workers`, make the `Observation`, step the
planner, and carry out its actions with `POST /admin/workers` (`start` N of a role; `drain` N of
a role, newest first: a draining worker takes nothing new and finishes what it holds). A start
that fails shows up as a `failed` worker, which the next observation does not count, so the next
decision asks again: nothing waits on a replica that never became healthy.
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
from tokenmill.planner.planner import Planner
from tokenmill.planner.prometheus_observer import observe, scrape

log = logging.getLogger(__name__)


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
    _last: dict[str, Any] | None = None
    _started: float = field(default_factory=time.monotonic)

    async def run(self, stop: asyncio.Event) -> None:
        """Decide every interval until `stop` is set (the first scrape only sets the baseline)."""
        self._last = scrape(await self._text("/metrics"))
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
                return
            except TimeoutError:
                pass
            try:
                if self.paused:
                    self._last = scrape(await self._text("/metrics"))  # resumed, it plans on fresh intervals
                else:
                    await self.tick()
            except httpx.HTTPError as exc:  # the frontend is away: hold, and try again next interval
                log.warning("planner: the deployment did not answer (%s); holding", exc)

    async def tick(self) -> Decision:
        now = scrape(await self._text("/metrics"))
        workers = await self.workers()
        obs = observe(self._last or now, now, time.monotonic() - self._started, self.interval_s, workers,
                      self.warmup_s)
        self._last = now
        decision = self.planner.step(obs)
        if self.metrics is not None:
            self.metrics.record(decision)
        for action in decision.actions:
            await self._execute(action.role, action.delta)
        return decision

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
