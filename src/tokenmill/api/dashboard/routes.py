"""The dashboard's routes.

- `GET /dashboard`: the page (open, as `/metrics` is: it shows only what `/metrics` says).
- `GET /dashboard/events?window_s=W`: server-sent events (`stream.py`), each point's figures over
  the W seconds before it (default 5, at most 600).
- `GET/POST /admin/settings`: the toggles (`settings.py`); `GET/POST /admin/scenarios`: the
  built-in loads (`scenarios.py`). Guarded by the admin key like every `/admin` route; answered
  by `tokenmill serve` (the toggles act on the workers it runs).
"""
from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from tokenmill.api.body import json_of, read_body
from tokenmill.api.dashboard import Dashboard
from tokenmill.api.dashboard.stream import DEFAULT_WINDOW_S, MAX_WINDOW_S
from tokenmill.api.errors import APIError, invalid_param


def dashboard_router(dashboard: Dashboard, max_body_bytes: int) -> APIRouter:
    router = APIRouter()
    page = resources.files("tokenmill.api.dashboard").joinpath("static/dashboard.html").read_text("utf-8")

    @router.get("/dashboard")
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page)

    @router.get("/dashboard/events")
    async def dashboard_events(request: Request) -> StreamingResponse:
        window_s = _window(request.query_params.get("window_s"))
        return StreamingResponse(dashboard.sampler.events(window_s), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @router.get("/admin/settings")
    async def get_settings() -> JSONResponse:
        return JSONResponse(_settings(dashboard).describe())

    @router.post("/admin/settings")
    async def post_settings(request: Request) -> JSONResponse:
        body = json_of(await read_body(request, max_body_bytes))
        return JSONResponse(await _settings(dashboard).apply(body))

    @router.get("/admin/scenarios")
    async def get_scenarios() -> JSONResponse:
        return JSONResponse(_scenarios(dashboard).describe())

    @router.post("/admin/scenarios")
    async def post_scenarios(request: Request) -> JSONResponse:
        body = json_of(await read_body(request, max_body_bytes))
        return JSONResponse(await _scenarios(dashboard).command(body))

    return router


def _settings(dashboard: Dashboard) -> Any:
    if dashboard.settings is None:
        raise APIError(404, "/admin/settings is served by `tokenmill serve`, which runs the workers; this "
                            "frontend does not", code="not_found")
    return dashboard.settings


def _scenarios(dashboard: Dashboard) -> Any:
    if dashboard.scenarios is None:
        raise APIError(503, "the scenarios start with the server", "server_error", code="service_unavailable")
    return dashboard.scenarios


def _window(raw: str | None) -> float:
    if raw is None:
        return DEFAULT_WINDOW_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_WINDOW_S:
        raise invalid_param("window_s", f"window_s must be a number of seconds in (0, {MAX_WINDOW_S:g}], got {raw!r}")
    return value

