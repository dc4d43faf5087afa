"""The generation endpoints, dispatched straight from ASGI.

Every request through FastAPI crosses its middleware stack, exception wrappers, route
matching and dependency solving: on the completions path that was a third of the
frontend's CPU per request, for nothing those routes use. `HotRoutes` sits in front of
the FastAPI app: /v1/completions and /v1/chat/completions go directly to their handlers
(any method but POST is a 405), with their exceptions mapped by the same `error_response`
the FastAPI app uses; every other request (and the lifespan) goes to the FastAPI app.
Every HTTP request passes the API-key check here first (`auth.py`), whichever app serves it.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.api.access_log import AccessLog
from tokenmill.api.auth import ApiKeys
from tokenmill.api.errors import APIError, error_response

Handler = Callable[[Request], Awaitable[ASGIApp]]  # a response is an ASGI app


class HotRoutes:
    def __init__(self, app: FastAPI, handlers: dict[str, Handler],
                 count_error: Callable[[int], None] | None = None, keys: ApiKeys = ApiKeys(),
                 access_log: AccessLog | None = None) -> None:
        self.app = app
        self.handlers = handlers
        self.count_error = count_error
        self.keys = keys
        self.access_log = access_log or AccessLog()

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
            if self.keys.required_for(scope["path"]) is not None:  # (no key configured: no header parsing)
                self.keys.check(scope["path"], request.headers.get("authorization"))
            elif scope["path"].startswith("/admin/"):
                client = scope.get("client")
                self.keys.check_origin(scope["path"], client[0] if client else None)
        except APIError as exc:
            await error_response(request, exc, self.count_error)(scope, receive, send)
            return
        if handler is None:
            await self.app(scope, receive, send)
        elif self.access_log.active():
            await self.access_log.serve(request, send, lambda logged: self._generate(handler, request, logged))
        else:
            await self._generate(handler, request, send)

    async def _generate(self, handler: Handler, request: Request, send: Send) -> None:
        try:
            if request.method != "POST":
                raise HTTPException(405, "Method Not Allowed", headers={"Allow": "POST"})
            response = await handler(request)
        except Exception as exc:  # every failure becomes an OpenAI error response
            response = error_response(request, exc, self.count_error)
        await response(request.scope, request.receive, send)
