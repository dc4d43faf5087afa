"""Server-side loads the dashboard starts and stops (`GET/POST /admin/scenarios`).

A scenario sends its requests to this very app through an in-memory ASGI transport (no socket;
the same routes, keys and metrics as any client), with Poisson arrivals at `rate` requests per
second from `seed` (`risk`, `trial`), or at a trace's own times divided by `rate_scale`
(`trace`). Starting a running scenario changes its rate. At most `MAX_IN_FLIGHT` of a
scenario's requests are in flight: arrivals beyond are counted as skipped, so a slow deployment
is not buried under an ever-growing backlog. Every start and stop is marked on the charts.

Body: `{"action": "start", "scenario": "risk"|"trial", "rate": r, "seed": s}`,
`{"action": "start", "scenario": "trace", "path": P, "rate_scale": k}`,
`{"action": "stop", "scenario": NAME}`; a 400 names the field at fault.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.api.errors import invalid_param
from tokenmill.workloads.demo import DemoRequest, RiskSynthesis, TrialProtocol, trace_requests

log = logging.getLogger(__name__)

SCENARIOS = ("risk", "trial", "trace")
MAX_RATE = 100.0
MAX_IN_FLIGHT = 32
REQUEST_TIMEOUT_S = 600.0


@dataclass(slots=True)
class ScenarioRun:
    name: str
    rate: float
    seed: int
    source: RiskSynthesis | TrialProtocol | None = None  # None: a trace
    task: asyncio.Task[None] | None = None
    started_at: float = field(default_factory=time.time)
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0
    busy: set[int] = field(default_factory=set)  # trial agents waiting for an answer
    in_flight: set[asyncio.Task[None]] = field(default_factory=set)

    def to_json(self) -> dict[str, Any]:
        return {"running": self.task is not None and not self.task.done(), "rate": self.rate, "seed": self.seed,
                "started_at": round(self.started_at, 3), "sent": self.sent, "succeeded": self.succeeded,
                "failed": self.failed, "skipped": self.skipped, "in_flight": len(self.in_flight)}


class Scenarios:
    """`client` posts to the app; `count_tokens` is the frontend's tokenizer; `context_length()` the
    longest prompt and answer every worker takes; `mark(label)` marks the charts."""

    def __init__(self, client: httpx.AsyncClient, count_tokens: Callable[[str], int], model: str,
                 context_length: Callable[[], int], block_size: Callable[[], int], vocab_size: Callable[[], int],
                 mark: Callable[[str], None]) -> None:
        self.client, self.count_tokens, self.model = client, count_tokens, model
        self.context_length, self.block_size, self.vocab_size = context_length, block_size, vocab_size
        self.mark = mark
        self.runs: dict[str, ScenarioRun] = {}

    def describe(self) -> dict[str, Any]:
        idle = {"running": False, "rate": 1.0}
        return {name: self.runs[name].to_json() if name in self.runs else dict(idle) for name in SCENARIOS}

    async def command(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise invalid_param(None, "the body must be a JSON object")
        action, name = body.get("action"), body.get("scenario")
        if action not in ("start", "stop"):
            raise invalid_param("action", f"'action' must be start or stop, got {action!r}")
        if name not in SCENARIOS:
            raise invalid_param("scenario", f"'scenario' must be one of {', '.join(SCENARIOS)}, got {name!r}")
        if action == "stop":
            await self.stop(name)
        elif name == "trace":
            self._start_trace(body)
        else:
            self._start(name, _rate(body), _seed(body))
        return self.describe()

    def _start(self, name: str, rate: float, seed: int) -> None:
        run = self.runs.get(name)
        if run is not None and run.task is not None and not run.task.done():
            run.rate = rate  # the running loop reads it at its next arrival
            self.mark(f"{name} at {rate:g} req/s")
            return
        run = self.runs[name] = ScenarioRun(name, rate, seed, self._source(name, seed))
        run.task = asyncio.create_task(self._drive(run, self._poisson(run)))
        self.mark(f"{name} start, {rate:g} req/s")

    def _source(self, name: str, seed: int) -> RiskSynthesis | TrialProtocol:
        if name == "risk":
            return RiskSynthesis(seed, self.count_tokens, self.model, doc_tokens=min(1500, self.context_length() // 2))
        return TrialProtocol(seed, self.count_tokens, self.model, self.context_length())

    def _start_trace(self, body: dict[str, Any]) -> None:
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise invalid_param("path", "'path' must name a trace file on the server (Mooncake JSONL or Azure CSV)")
        scale = body.get("rate_scale", 1.0)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < scale <= 1000:
            raise invalid_param("rate_scale", f"'rate_scale' must be a number in (0, 1000], got {scale!r}")
        try:
            arrivals = list(trace_requests(path, float(scale), self.model, self.block_size(), self.vocab_size(),
                                           self.context_length()))
        except (OSError, ValueError) as exc:
            raise invalid_param("path", f"cannot replay {path}: {exc}") from exc
        if "trace" in self.runs and self.runs["trace"].task is not None:
            self.runs["trace"].task.cancel()
        run = self.runs["trace"] = ScenarioRun("trace", float(scale), 0)
        run.task = asyncio.create_task(self._drive(run, _timed(arrivals)))
        self.mark(f"trace start, {len(arrivals)} requests x{scale:g}")

    async def stop(self, name: str) -> None:
        run = self.runs.get(name)
        if run is None or run.task is None or run.task.done():
            return
        run.task.cancel()
        await asyncio.gather(run.task, return_exceptions=True)
        self.mark(f"{name} stop")

    async def close(self) -> None:
        for run in self.runs.values():
            if run.task is not None:
                run.task.cancel()
        await asyncio.gather(*(r.task for r in self.runs.values() if r.task is not None), return_exceptions=True)

    # ---- driving --------------------------------------------------------------------------

    @staticmethod
    async def _poisson(run: ScenarioRun) -> AsyncIterator[DemoRequest | None]:
        rng = random.Random(run.seed)
        while run.source is not None:
            await asyncio.sleep(rng.expovariate(run.rate))
            yield run.source.next(run.busy)

    async def _drive(self, run: ScenarioRun, arrivals: AsyncIterator[DemoRequest | None]) -> None:
        try:
            async for request in arrivals:
                if request is None or len(run.in_flight) >= MAX_IN_FLIGHT:
                    run.skipped += 1
                    continue
                task = asyncio.create_task(self._send(run, request))
                run.in_flight.add(task)
                task.add_done_callback(run.in_flight.discard)
        finally:
            for task in list(run.in_flight):  # stopped: what it sent is abandoned, as a client would
                task.cancel()

    async def _send(self, run: ScenarioRun, request: DemoRequest) -> None:
        run.sent += 1
        if request.agent is not None:
            run.busy.add(request.agent)
        text = None
        try:
            reply = await self.client.post(request.route, json=request.body, timeout=REQUEST_TIMEOUT_S)
            if reply.status_code == 200:
                run.succeeded += 1
                choice = reply.json()["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice.get("text")
            else:
                run.failed += 1
                log.warning("%s request failed: %d %s", run.name, reply.status_code, reply.text[:200])
        except httpx.HTTPError as exc:
            run.failed += 1
            log.warning("%s request failed: %s", run.name, exc)
        finally:
            if request.agent is not None and isinstance(run.source, TrialProtocol):
                run.busy.discard(request.agent)
                run.source.answered(request.agent, text)


async def _timed(arrivals: list[tuple[float, DemoRequest]]) -> AsyncIterator[DemoRequest]:
    start = time.monotonic()
    for at, request in arrivals:
        delay = start + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        yield request


def _rate(body: dict[str, Any]) -> float:
    rate = body.get("rate", 1.0)
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate <= MAX_RATE:
        raise invalid_param("rate", f"'rate' must be a number of requests per second in (0, {MAX_RATE:g}], "
                                    f"got {rate!r}")
    return float(rate)


def _seed(body: dict[str, Any]) -> int:
    seed = body.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise invalid_param("seed", f"'seed' must be a non-negative integer, got {seed!r}")
    return seed
