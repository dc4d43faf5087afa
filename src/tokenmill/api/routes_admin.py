"""Admin routes (guarded by the admin key, `auth.py`).

`POST /admin/pin` pins a prefix (a system prompt, a shared corpus) in every worker's KV tiers,
so it is never evicted from them and other replicas can load it. Body: exactly one of `prompt`
(a string, tokenized as `/v1/completions` does, or a list of token ids) and `messages` (chat
messages, rendered with the chat template and no generation prompt, so the result is a prefix of
any conversation that starts with them). Answer: `{"pinned": bool, "num_tokens": n, "workers":
{worker_id: null | "why not"}}`; `pinned` is true when every worker pinned it. Only full KV
blocks are pinned.

`GET /admin/router/index[?hashes=true]` shows what each router's KV index holds, per pool, worker
and tier: block counts and an order-free digest (`router/index_view.py`), the hashes on request;
404 where no router runs (one embedded engine).

`GET /admin/tenants` lists the tenants of `--tenants FILE` (`tenants/usage.py`): class, weight,
quotas, requests in flight and waiting for a slot (`--max-in-flight`), finished requests by
outcome, refusals by quota and tokens; 404 without a tenants file.

`GET /admin/workers` lists `tokenmill serve`'s workers (`fleet/worker_control.py`: name, role, state,
pid, in-flight requests, started_at, and live replicas counted by role and state); `POST
/admin/workers` changes them, answering 202 with the records it touched:
`{"action": "start", "role": R, "count": N}` -> `{"started": [...]}`;
`{"action": "drain", "worker": NAME}` or `{"action": "drain", "role": R, "count": N}` (the newest
serving ones) -> `{"drained": [...]}`; `{"action": "rerole", "worker": NAME, "to": R}` -> both.
Client mistakes are 400s naming the field, an unknown worker a 404, and a drain that would leave
no agg/decode worker serving (unless the pool may scale to zero) or of a worker not serving a 409. The other API servers of a
`--api-servers N` deployment forward these two routes to the serve process (`fleet/control_socket.py`).
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.api.body import json_of, read_body
from tokenmill.api.errors import SERVER_ERROR, APIError, error_body, invalid_param, refused_error
from tokenmill.api.generation import ServingContext
from tokenmill.fleet.control_socket import CONTROL_SOCKET_ENV, forward
from tokenmill.fleet.worker_control import NAME_PREFIX, WorkerCommandRefused, WorkerControl
from tokenmill.textgen.tokenizer import Tokenizer

ACTIONS = ("start", "drain", "rerole")
MAX_COUNT = 64  # workers one request may start or drain
_FIELDS = {"start": {"action", "role", "count"}, "drain": {"action", "worker", "role", "count"},
           "rerole": {"action", "worker", "to"}}


@dataclass(slots=True, frozen=True)
class WorkerCommand:
    action: str
    role: str | None = None
    count: int = 1
    worker: str | None = None
    to: str | None = None


def pin_token_ids(body: Any, tokenizer: Tokenizer) -> list[int]:
    """The token ids a pin request names; APIError (400) naming the field otherwise."""
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise invalid_param(None, "give exactly one of 'prompt' and 'messages'")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise invalid_param("messages", "'messages' must be a non-empty list of message objects")
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
    prompt = body["prompt"]
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise invalid_param("prompt", "'prompt' must be a non-empty string or list of token ids")


def parse_worker_command(body: Any, roles: tuple[str, ...]) -> WorkerCommand:
    """A `POST /admin/workers` body, checked against the deployment's roles; 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid_param(None, "the body must be a JSON object")
    action = body.get("action")
    if action not in ACTIONS:
        raise invalid_param("action", f"'action' must be one of {', '.join(ACTIONS)}, got {action!r}")
    unknown = sorted(set(body) - _FIELDS[action])
    if unknown:
        raise invalid_param(unknown[0], f"{action!r} takes only {', '.join(sorted(_FIELDS[action]))}; "
                                        f"got {unknown[0]!r}")
    if action == "rerole":
        return WorkerCommand(action, worker=_worker_name(body), to=_role(body, "to", roles))
    if action == "drain" and "worker" in body:
        if "role" in body or "count" in body:
            raise invalid_param("worker", "drain takes either 'worker' or 'role' and 'count', not both")
        return WorkerCommand(action, worker=_worker_name(body))
    return WorkerCommand(action, role=_role(body, "role", roles), count=_count(body))


def _role(body: dict[str, Any], field: str, roles: tuple[str, ...]) -> str:
    role = body.get(field)
    if role not in NAME_PREFIX:
        raise invalid_param(field, f"'{field}' must be one of {', '.join(NAME_PREFIX)}, got {role!r}")
    if role not in roles:
        kind = "an aggregated" if roles == ("agg",) else "a disaggregated"
        raise invalid_param(field, f"{kind} deployment has no {role} workers: '{field}' must be one of "
                                   f"{', '.join(roles)}")
    return role


def _count(body: dict[str, Any]) -> int:
    count = body.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
        raise invalid_param("count", f"'count' must be an integer from 1 to {MAX_COUNT}, got {count!r}")
    return count


def _worker_name(body: dict[str, Any]) -> str:
    name = body.get("worker")
    if not isinstance(name, str) or not name:
        raise invalid_param("worker", f"'worker' must be a worker's name (GET /admin/workers), got {name!r}")
    return name



async def answer_workers(control: WorkerControl, method: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of `GET`/`POST /admin/workers`, errors included."""
    try:
        if method == "GET":
            return 200, control.snapshot()
        return 202, run_worker_command(control, parse_worker_command(json_of(raw), control.roles))
    except WorkerCommandRefused as exc:
        return _error(refused_error(exc))
    except APIError as exc:
        return _error(exc)


def _error(exc: APIError) -> tuple[int, dict[str, Any]]:
    return exc.status, error_body(exc.detail)


async def _workers_route(ctx: ServingContext, method: str, raw: bytes) -> JSONResponse:
    """Answered here in the serve process, forwarded to it from its other API servers."""
    control = getattr(ctx.backend, "worker_control", None)
    forward_to = os.environ.get(CONTROL_SOCKET_ENV)
    if control is not None:
        status, body = await answer_workers(control, method, raw)
    elif forward_to:
        try:
            status, body = await forward(forward_to, method, raw)
        except ConnectionError as exc:
            raise APIError(503, str(exc), SERVER_ERROR, code="service_unavailable") from exc
    else:
        raise APIError(404, "/admin/workers is served by `tokenmill serve`, which runs the worker processes; "
                            "this frontend does not", code="not_found")
    error = body.get("error") if status >= 400 else None
    if isinstance(error, dict):  # raised, so the error metrics count it as any other
        raise APIError(status, str(error.get("message")), str(error.get("type")), error.get("param"),
                       error.get("code"))
    return JSONResponse(body, status_code=status)


def run_worker_command(control: WorkerControl, command: WorkerCommand) -> dict[str, Any]:
    if command.action == "start":
        started = control.start(command.role, command.count)
        return {"action": "start", "started": [control.describe(r) for r in started]}
    if command.action == "drain":
        param = "worker" if command.worker else "role"
        names = [command.worker] if command.worker else control.newest(command.role, command.count)
        return {"action": "drain", "drained": [control.describe(r) for r in control.drain(names, param)]}
    drained, started = control.rerole(command.worker, command.to)
    return {"action": "rerole", "drained": [control.describe(drained)], "started": [control.describe(started)]}


def admin_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/admin/pin")
    async def pin(request: Request) -> JSONResponse:
        body = json_of(await read_body(request, ctx.max_body_bytes))
        ids = await asyncio.to_thread(pin_token_ids, body, ctx.backend.tokenizer)
        if len(ids) >= ctx.backend.max_model_len:
            raise invalid_param("prompt", f"prefix has {len(ids)} tokens; the context length is "
                                          f"{ctx.backend.max_model_len}")
        workers = await ctx.backend.pin_prefix(ids)
        pinned = bool(workers) and all(why is None for why in workers.values())
        return JSONResponse({"pinned": pinned, "num_tokens": len(ids), "workers": workers})

    @router.get("/admin/planner")
    async def planner_decisions(request: Request) -> JSONResponse:
        if ctx.planner is None:
            raise APIError(404, "no planner runs in this process (tokenmill serve --planner sla|load|hybrid)",
                           code="not_found")
        last = request.query_params.get("last", "50")
        if not last.isdigit():
            raise invalid_param("last", f"last must be a non-negative integer, got {last!r}")
        decisions = ctx.planner.decisions()
        return JSONResponse({"object": "list", "mode": ctx.planner.deployment.planner.mode,
                             "data": decisions[-int(last):] if int(last) else []})

    @router.get("/admin/router/index")
    async def router_index(request: Request) -> JSONResponse:
        view = getattr(ctx.backend, "router_index", None)
        if view is None:
            raise APIError(404, "no KV router in this process (it serves one embedded engine)", code="not_found")
        hashes = request.query_params.get("hashes", "false").lower()
        if hashes not in ("true", "false"):
            raise invalid_param("hashes", f"hashes must be true or false, got {hashes!r}")
        return JSONResponse(view(hashes == "true"))

    @router.get("/admin/tenants")
    async def tenants() -> JSONResponse:
        if ctx.tenancy is None:
            raise APIError(404, "no tenants here (serve or frontend --tenants FILE)", code="not_found")
        rows = ctx.tenancy.table()
        for row in rows:  # streams waiting for one of the fleet's slots (--max-in-flight)
            row["waiting"] = 0 if ctx.queue is None else ctx.queue.fair.waiting_for(row["name"])
        return JSONResponse({"object": "list", "file": ctx.tenancy.tenants.path, "data": rows})

    @router.get("/admin/workers")
    async def list_workers() -> JSONResponse:
        return await _workers_route(ctx, "GET", b"")

    @router.post("/admin/workers")
    async def change_workers(request: Request) -> JSONResponse:
        return await _workers_route(ctx, "POST", await read_body(request, ctx.max_body_bytes))

    return router
