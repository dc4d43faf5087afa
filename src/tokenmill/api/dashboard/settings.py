"""Runtime toggles of a running `tokenmill serve`, behind `GET/POST /admin/settings`: what the
dashboard's switches change, through the same route a script would use.

- `kv_routing`: the decode (or aggregated) pool's router between `kv` and `round-robin`. Its
  KV index keeps following the workers' events, so turning it back on routes on a current
  index. Available when the deployment was launched routing on `kv`.
- `managed_cache`: the KV tiers below the device pool (host, disk, shared) on every worker, and
  workers that join later: off, a worker neither stores to nor loads from them (what they hold
  stays, unserved), and the routers count device blocks only. Available when workers have tiers.
- `disaggregation`: re-roles the workers between aggregated and prefill/decode at equal worker
  count (one aggregated worker becomes 1 prefill + 1 decode): the new workers start, and once
  every one serves, the old ones drain (each finishes what it holds: no request is lost). One
  change at a time; if a start fails, the new workers drain and the old ones stay.
- `planner`: pauses or resumes an in-process planner (`serve --planner`).

A toggle that the deployment cannot honour is `null` in the JSON and a 409 naming it; a body
that is not an object of booleans is a 400 naming the field.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from tokenmill.api.errors import APIError, invalid_param
from tokenmill.fleet.worker_control import FAILED, SERVING, WorkerCommandRefused, WorkerControl

log = logging.getLogger(__name__)

TOGGLES = ("disaggregation", "kv_routing", "managed_cache", "planner")
ALL_ROLES = ("agg", "prefill", "decode")
POLL_S = 0.2


class Settings:
    """`backend` is the serve process's `DistributedBackend`; `planner()` its `PlannerTask` (None
    without one; it starts after the app); `mark(label)` records a change on the dashboard."""

    def __init__(self, backend: Any, control: WorkerControl | None, planner: Callable[[], Any],
                 mark: Callable[[str], None], api_servers: int = 1) -> None:
        self.backend = backend
        self.control = control
        self.planner = planner
        self.mark = mark
        self.api_servers = api_servers
        self.cache_enabled = True
        self.disaggregated = control is not None and control.roles != ("agg",)  # changes once re-roled
        self.busy: str | None = None  # the re-roling under way
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None

    def describe(self) -> dict[str, Any]:
        pool = self.backend.pool
        return {"disaggregation": self.disaggregated if self.control is not None else None,
                "kv_routing": (pool.router.policy == "kv") if pool.router.indexer is not None else None,
                "managed_cache": self.cache_enabled if pool.has_tiers() else None,
                "planner": (not self.planner().deployment.paused) if self.planner() is not None else None,
                "busy": self.busy, "last_error": self.last_error}

    async def apply(self, body: Any) -> dict[str, Any]:
        """Check the whole body, then change what it asks; the settings after."""
        wanted = self._parse(body)
        current = self.describe()
        for name, value in wanted.items():
            if current[name] is None:
                raise APIError(409, self._unavailable(name), param=name, code="setting_unavailable")
        if self.api_servers > 1:
            raise APIError(409, "the toggles act on this process's router and workers: run with --api-servers 1",
                           param=next(iter(wanted)), code="setting_unavailable")
        if "disaggregation" in wanted and wanted["disaggregation"] != current["disaggregation"]:
            self._check_can_reroll(current)
        for name, value in wanted.items():
            if value != current[name]:
                getattr(self, "_set_" + name)(value)
        return self.describe()

    def _parse(self, body: Any) -> dict[str, bool]:
        if not isinstance(body, dict) or not body:
            raise invalid_param(None, f"the body must be a JSON object setting some of {', '.join(TOGGLES)}")
        for name, value in body.items():
            if name not in TOGGLES:
                raise invalid_param(name, f"unknown setting {name!r}: the settings are {', '.join(TOGGLES)}")
            if not isinstance(value, bool):
                raise invalid_param(name, f"'{name}' must be true or false, got {value!r}")
        return dict(body)

    def _unavailable(self, name: str) -> str:
        return {"disaggregation": "re-roling workers needs `tokenmill serve`, which runs them",
                "kv_routing": "KV-aware routing needs a deployment launched with --router kv (its workers "
                              "publish KV events)",
                "managed_cache": "no worker has KV tiers (--kv-host-gb, --kv-disk-dir or --kv-shared)",
                "planner": "no planner runs in this process (tokenmill serve --planner sla|load|hybrid)"}[name]

    def _check_can_reroll(self, current: dict[str, Any]) -> None:
        if self.busy is not None:
            raise APIError(409, f"a change is under way: {self.busy}", param="disaggregation", code="busy")
        if current["planner"]:
            raise APIError(409, "the planner sizes the pools it was started for: pause it before re-roling",
                           param="disaggregation", code="planner_running")

    # ---- the toggles ------------------------------------------------------------------------

    def _set_kv_routing(self, on: bool) -> None:
        self.backend.pool.router.set_policy("kv" if on else "round-robin")
        self.mark(f"KV routing {'on' if on else 'off'}")

    def _set_managed_cache(self, on: bool) -> None:
        self.cache_enabled = on
        self.backend.pool.use_tiers(on)
        self.mark(f"managed cache {'on' if on else 'off'}")

    def _set_planner(self, on: bool) -> None:
        self.planner().deployment.paused = not on
        self.mark(f"planner {'on' if on else 'off'}")

    def _set_disaggregation(self, on: bool) -> None:
        self.busy = "disaggregation " + ("on" if on else "off")
        self.last_error = None
        self._task = asyncio.create_task(self._reroll(self.control, on))

    async def _reroll(self, control: WorkerControl, on: bool) -> None:
        old = [r.name for r in control.records.values() if r.state == SERVING]
        n = max(len(old), 1)
        plan = {"prefill": max(1, n // 2), "decode": max(1, n - n // 2)} if on else {"agg": n}
        label = f"disaggregation {'on' if on else 'off'}"
        self.mark(f"{label}: starting " + ", ".join(f"{count} {role}" for role, count in plan.items()))
        try:
            outcome = await self._replace(control, old, plan, ("prefill", "decode") if on else ("agg",))
        except WorkerCommandRefused as exc:  # a worker went away meanwhile: keep what serves, and say so
            self.last_error = str(exc)
            outcome = "stopped"
        finally:
            self.busy = None
        self.mark(f"{label}: {outcome}")

    async def _replace(self, control: WorkerControl, old: list[str], plan: dict[str, int],
                       roles: tuple[str, ...]) -> str:
        """Start the workers of `plan`; once all serve, drain `old` and take `roles`. On a failed
        start, drain the new ones instead and keep the old roles."""
        kept, control.roles = control.roles, ALL_ROLES
        try:  # whatever is raised meanwhile, the roles are the old ones or, once done, the new ones
            started = [rec.name for role, count in plan.items() for rec in control.start(role, count)]
            failed = await self._wait_serving(control, started)
            if failed is not None:
                self.last_error = f"{failed} did not start: {control.records[failed].reason}"
                control.drain([name for name in started if control.records[name].state == SERVING])
                return "failed, nothing changed"
            control.drain(old)
            kept = roles
            self.disaggregated = roles != ("agg",)
            return "done"
        finally:
            control.roles = kept

    @staticmethod
    async def _wait_serving(control: WorkerControl, names: list[str]) -> str | None:
        """Wait until every worker named serves; the first that failed, if any."""
        while True:
            control.observe()
            for name in names:
                if control.records[name].state == FAILED:
                    return name
            if all(control.records[name].state == SERVING for name in names):
                return None
            await asyncio.sleep(POLL_S)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
