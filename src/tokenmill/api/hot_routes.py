"""The generation endpoints, dispatched straight from ASGI.

Every request through FastAPI crosses its middleware stack, exception wrappers, route
matching and dependency solving: on the completions path that was a third of the
frontend's CPU per request, for nothing those routes use. `HotRoutes` sits in front of
the FastAPI app: /v1/completions and /v1/chat/completions go directly to their handlers
(any method but POST is a 405), with their exceptions mapped by the same `error_response`
the FastAPI app uses; every other request (and the lifespan) goes to the FastAPI app.
Every HTTP request passes the API-key check here first (`auth.py`), whichever app serves it;
with tenants (`tenancy.py`) a `/v1` request names its tenant by its key instead, and a generation
request passes its tenant's quotas and waits for one of the fleet's slots (`--max-in-flight`).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.api.access_log import AccessLog
from tokenmill.api.auth import ApiKeys
from tokenmill.api.errors import APIError, error_response
from tokenmill.api.tenancy import FleetQueue, authenticate, request_scope
from tokenmill.tenants.usage import Tenancy, TenantAccount

Handler = Callable[[Request], Awaitable[ASGIApp]]  # a response is an ASGI app


class HotRoutes:
    def __init__(self, app: FastAPI, handlers: dict[str, Handler],
                 count_error: Callable[[int], None] | None = None, keys: ApiKeys = ApiKeys(),
                 access_log: AccessLog | None = None, tenancy: Tenancy | None = None,
                 queue: FleetQueue | None = None) -> None:
        self.app = app
        self.handlers = handlers
        self.count_error = count_error
        self.keys = keys
        self.access_log = access_log or AccessLog()
        self.tenancy = tenancy
        self.queue = queue

    @property
    def state(self):  # what callers of create_app read off a FastAPI app
        return self.app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handler = self.handlers.get(scope["path"])
        request = Request(scope, receive, send)
        try:
            account = self._check_key(scope, request)
        except APIError as exc:
            await error_response(request, exc, self.count_error)(scope, receive, send)
            return
        if handler is None:
            await self.app(scope, receive, send)
            return
        serve = self._generate if account is None and self.queue is None else partial(self._scoped, account)
        if self.access_log.active():
            await self.access_log.serve(request, send, lambda logged: serve(handler, request, logged))
        else:
            await serve(handler, request, send)

    def _check_key(self, scope: Scope, request: Request) -> TenantAccount | None:
        """Raises the 401 (or the 403 of an unguarded admin route off this host); a `/v1` request's
        tenant where there are tenants."""
        path = scope["path"]
        if self.tenancy is not None and (path == "/v1" or path.startswith("/v1/")):
            return authenticate(self.tenancy, request.headers.get("authorization"))
        if self.keys.required_for(path) is not None:  # (no key configured: no header parsing)
            self.keys.check(path, request.headers.get("authorization"))
        elif path.startswith("/admin/"):
            client = scope.get("client")
            self.keys.check_origin(path, client[0] if client else None)
        return None

    async def _scoped(self, account: TenantAccount | None, handler: Handler, request: Request, send: Send) -> None:
        """A generation request within its tenant's quotas and one of the fleet's slots: refused
        with 429 or 503 on the way in (neither counted as the fleet's own refusals), else served as
        any other while it holds them."""
        async with AsyncExitStack() as held:
            try:
                await held.enter_async_context(request_scope(account, self.queue))
            except APIError as exc:
                await error_response(request, exc, None)(request.scope, request.receive, send)
                return
            await self._generate(handler, request, send)

    async def _generate(self, handler: Handler, request: Request, send: Send) -> None:
        try:
            if request.method != "POST":
                raise HTTPException(405, "Method Not Allowed", headers={"Allow": "POST"})
            response = await handler(request)
        except Exception as exc:  # every failure becomes an OpenAI error response
            response = error_response(request, exc, self.count_error)
        await response(request.scope, request.receive, send)
