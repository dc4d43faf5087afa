"""The OpenAI-compatible HTTP app over any `Backend`.

`create_app(backend, served_model_name)` wires the routes, the OpenAI error
handlers and a per-app metrics registry; the generation endpoints skip FastAPI's
dispatch (`hot_routes.py`). The app starts the backend when it starts
and stops it when it stops, unless `manage_backend=False` (the caller owns it).
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenmill.api.access_log import AccessLog
from tokenmill.api.auth import ApiKeys
from tokenmill.api.body import DEFAULT_MAX_BODY_BYTES
from tokenmill.api.dashboard import Dashboard
from tokenmill.api.dashboard.routes import dashboard_router
from tokenmill.api.errors import APIError, error_json, install_error_handlers
from tokenmill.api.generation import ServingContext
from tokenmill.api.hot_routes import HotRoutes
from tokenmill.api.metrics import FrontendMetrics
from tokenmill.api.request_args import check_model
from tokenmill.api.routes_admin import admin_router
from tokenmill.api.routes_chat import create_chat_completion
from tokenmill.api.routes_completions import create_completion
from tokenmill.api.routes_responses import create_response
from tokenmill.api.schema import ModelCard, ModelList
from tokenmill.api.tenancy import FleetQueue
from tokenmill.backend import Backend
from tokenmill.tenants.config import Tenants
from tokenmill.tenants.usage import Tenancy

log = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT_S = 600.0


def create_app(backend: Backend, served_model_name: str, *, usd_per_worker_hour: float | None = None,
               request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, manage_backend: bool = True,
               keys: ApiKeys = ApiKeys(), access_log: bool = True, tool_call_parser: str | None = None,
               api_servers: int = 1, tenants: Tenants | None = None, queue: FleetQueue | None = None) -> HotRoutes:
    """The ASGI app. `request_timeout_s` is every request's deadline (None: none);
    `usd_per_worker_hour` enables the `tokenmill_cost_per_million_tokens` gauge;
    `keys` guard the `/v1` and `/admin` routes (`auth.py`); `access_log` writes a line per
    generation request (`access_log.py`); `tool_call_parser` overrides the chat template's call format;
    `api_servers` is how many frontends share the deployment (the dashboard's toggles need one);
    `tenants` name each `/v1` caller by its key, with its quotas, and `queue` holds the streams past
    the fleet's slots (`tenancy.py`)."""
    metrics = FrontendMetrics(backend.metrics_snapshot, usd_per_worker_hour)
    tenancy = None if tenants is None else Tenancy(tenants, metrics.registry, usd_per_worker_hour or 0.0)
    ctx = ServingContext(backend, metrics, served_model_name, request_timeout_s, max_body_bytes, int(time.time()),
                         tool_call_parser, tenancy=tenancy, queue=queue)

    dashboard = Dashboard(ctx, keys.api, api_servers)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_backend:
            await backend.start()
        dashboard.start()
        try:
            yield
        finally:
            await dashboard.stop()
            if manage_backend:
                await backend.stop()

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = ctx
    install_error_handlers(app, metrics.count_http_error)
    app.include_router(admin_router(ctx))
    app.include_router(dashboard_router(dashboard, max_body_bytes))
    _add_service_routes(app, ctx)
    hot = {"/v1/completions": partial(create_completion, ctx),
           "/v1/chat/completions": partial(create_chat_completion, ctx),
           "/v1/responses": partial(create_response, ctx)}
    outer = HotRoutes(app, hot, metrics.count_http_error, keys, AccessLog(access_log), tenancy, queue)
    dashboard.attach(outer)
    return outer


def _model_card(ctx: ServingContext) -> ModelCard:
    return ModelCard(id=ctx.served_model_name, created=ctx.created, max_model_len=ctx.backend.max_model_len)


def _add_service_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(ModelList(data=[_model_card(ctx)]).model_dump(mode="json"))

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> JSONResponse:
        check_model(model, ctx.served_model_name)
        return JSONResponse(_model_card(ctx).model_dump(mode="json"))

    @app.api_route("/v1/embeddings", methods=["POST"])
    async def embeddings() -> Response:
        # vLLM and Dynamo serve embeddings only from an embedding (pooling) model; say so, and what is served
        raise APIError(404, f"/v1/embeddings is not served: `{ctx.served_model_name}` is a generative model, served "
                            "at /v1/completions, /v1/chat/completions and /v1/responses; embeddings need a server "
                            "running an embedding model", code="not_found")

    @app.get("/health")
    async def health() -> Response:
        if ctx.backend.healthy():
            return JSONResponse({"status": "ok"})
        # Returned, not raised: a probe is not a request, so it stays out of the request metrics.
        return error_json(APIError(503, "no worker can serve requests", "server_error", code="service_unavailable"))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
