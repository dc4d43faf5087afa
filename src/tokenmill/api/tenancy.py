"""Tenants and the fleet's slots at the HTTP edge (`tenants/`).

With `--tenants FILE` a `/v1` request names its tenant by its key (401 for a key no tenant holds),
and a generation request must pass its tenant's quotas (429 with `Retry-After`, the message
naming the quota). With `--max-in-flight N` a generation request then waits for one of N slots,
released by its tenant's class and fair share (`tenants/fair_queue.py`; without tenants every
request is one default tenant's, in arrival order); a wait past `--queue-timeout-s` is a 503 with
`Retry-After`. A request holds its quota place and its slot until its response is sent, whatever
its streams do.

    async with request_scope(account, queue):   # APIError on entry: 429 (quota) or 503 (queue)
        ...                                      # the response, sent

Its scope travels with its task (`current_request`, set here): every stream it opens, `n` choices
included, is charged to its tenant and its slot by the frontend's own request bookkeeping
(`metrics.RequestTimer`) without each route passing it on.
"""
from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from tokenmill.api.auth import bearer_key, invalid_key
from tokenmill.api.errors import SERVER_ERROR, APIError
from tokenmill.tenants.config import Tenant
from tokenmill.tenants.fair_queue import FairQueue, QueueTimeout, Slot
from tokenmill.tenants.quotas import Refusal
from tokenmill.tenants.usage import Tenancy, TenantAccount

DEFAULT_TENANT = Tenant("default", ())  # every request's, where no tenants file names them


@dataclass(slots=True)
class FleetSlot:
    queue: FairQueue
    slot: Slot

    def charge(self, tokens: int) -> None:
        self.queue.charge(self.slot, tokens)


@dataclass(slots=True, frozen=True)
class RequestScope:
    account: TenantAccount | None  # its tenant's, with --tenants
    slot: FleetSlot | None  # the fleet's slot it holds, with --max-in-flight

    def finished(self, status: str, prompt_tokens: int, output_tokens: int, cached_tokens: int,
                 step_seconds: float = 0.0) -> None:
        """One of its streams ended, having caused `step_seconds` of the engine's steps."""
        if self.account is not None:
            self.account.finished(status, prompt_tokens, output_tokens, cached_tokens, step_seconds)
        if self.slot is not None:
            self.slot.charge(prompt_tokens + output_tokens)


current_request: ContextVar[RequestScope | None] = ContextVar("tokenmill_request_scope", default=None)


class FleetQueue:
    def __init__(self, max_in_flight: int, timeout_s: float | None, batch_share: float = 0.8) -> None:
        self.fair = FairQueue(max_in_flight, batch_share)
        self.timeout_s = timeout_s

    async def acquire(self, tenant: Tenant) -> FleetSlot:
        try:
            return FleetSlot(self.fair, await self.fair.acquire(tenant, self.timeout_s))
        except QueueTimeout as exc:
            raise APIError(503, f"{exc} (--queue-timeout-s); retry later", SERVER_ERROR, code="queue_timeout",
                           headers={"Retry-After": "1"}) from exc


def authenticate(tenancy: Tenancy, authorization: str | None) -> TenantAccount:
    key = bearer_key(authorization)
    account = None if key is None else tenancy.account_for(key)
    if account is None:
        raise invalid_key("invalid or missing API key: send a tenant's key as 'Authorization: Bearer <key>'")
    return account


@asynccontextmanager
async def request_scope(account: TenantAccount | None, queue: FleetQueue | None) -> AsyncIterator[None]:
    """A generation request past its quotas and the queue, charged for its streams meanwhile."""
    if account is not None and (refusal := account.admit()) is not None:
        raise quota_error(refusal)
    try:
        slot = None if queue is None else await queue.acquire(DEFAULT_TENANT if account is None else account.tenant)
        token = current_request.set(RequestScope(account, slot))
        try:
            yield
        finally:
            current_request.reset(token)
            if slot is not None:
                slot.queue.release(slot.slot)
    finally:
        if account is not None:
            account.release()


def quota_error(refusal: Refusal) -> APIError:
    return APIError(429, refusal.message, "rate_limit_error", code="tenant_quota_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(refusal.retry_after_s)))})
