"""The live dashboard: one page (`GET /dashboard`, no CDN: its canvas charts are its own code),
fed by a server-sent stream of what `/metrics` says (`stream.py`, `figures.py`), with toggles
that act on the running deployment (`settings.py`, `/admin/settings`) and server-side loads
(`scenarios.py`, `/admin/scenarios`). Every toggle and scenario change is a marker on the charts.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from tokenmill.api.dashboard.scenarios import Scenarios
from tokenmill.api.dashboard.settings import Settings
from tokenmill.api.dashboard.stream import Sampler


class Dashboard:
    """Built with the app; `attach(app)` once the outer ASGI app exists (scenarios post to it),
    `start()` and `stop()` with the app's lifespan."""

    def __init__(self, ctx: Any, api_key: str | None, api_servers: int = 1) -> None:
        self.ctx = ctx
        self.api_key = api_key
        backend = ctx.backend
        self.sampler = Sampler(ctx.metrics.registry.collect, self._block_size, self.state)
        control = getattr(backend, "worker_control", None)
        self.settings = (Settings(backend, control, lambda: ctx.planner, self.sampler.mark, api_servers)
                         if control is not None else None)
        self.scenarios: Scenarios | None = None
        self.app: Any = None
        self._task: asyncio.Task[None] | None = None

    def attach(self, app: Any) -> None:
        self.app = app

    def state(self) -> dict[str, Any]:
        settings = self.settings.describe() if self.settings is not None else {}
        return {"settings": settings, "scenarios": self.scenarios.describe() if self.scenarios else {},
                "tenants": getattr(self.ctx, "tenancy", None) is not None}  # the page then shows their table

    def _context_length(self) -> int:
        """The shortest context of the workers (a small KV pool shortens it) or the model's."""
        pool = getattr(self.ctx.backend, "pool", None)
        limits = [int(c.info.metadata["max_model_len"]) for c in pool.connections.values()
                  if c.info.metadata.get("max_model_len")] if pool is not None else []
        return min(limits, default=self.ctx.backend.max_model_len)

    def _block_size(self) -> int:
        pool = getattr(self.ctx.backend, "pool", None)
        return pool.hashing()[0] if pool is not None else 16

    def start(self) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per scenario request would bury the log
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://tokenmill",
                                   headers=headers)
        backend = self.ctx.backend
        self.scenarios = Scenarios(client, lambda text: len(backend.tokenizer.encode(text)),
                                   self.ctx.served_model_name, self._context_length, self._block_size,
                                   lambda: backend.tokenizer.vocab_size, self.sampler.mark)
        self._task = asyncio.create_task(self.sampler.run())

    async def stop(self) -> None:
        if self.scenarios is not None:
            await self.scenarios.close()
            await self.scenarios.client.aclose()
        if self.settings is not None:
            await self.settings.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
