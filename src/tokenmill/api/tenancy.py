"""Tenants at the HTTP edge (`serve/frontend --tenants FILE`, `tenants/`): a `/v1` request names
its tenant by its key (401 for a key no tenant holds), a generation request passes its tenant's
quotas (429 with `Retry-After` and a message naming the quota) and its streams are charged to
that tenant.

The request's account travels with its task (`current_account`, set here for the request's
lifetime): every stream it opens, `n` choices included, is charged by the frontend's own request
bookkeeping (`metrics.RequestTimer`) without each route passing it on.

With `--max-in-flight N` (`FleetQueue`) a stream past the fleet's N waits for a slot, released by
its tenant's class and fair share (`tenants/fair_queue.py`; without tenants every request is one
default tenant's, in arrival order); a wait past `--queue-timeout-s` is a 503 with `Retry-After`.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from tokenmill.api.errors import SERVER_ERROR, APIError
from tokenmill.tenants.config import Tenant
from tokenmill.tenants.fair_queue import FairQueue, QueueTimeout, Slot
from tokenmill.tenants.quotas import Refusal
from tokenmill.tenants.usage import Tenancy, TenantAccount

current_account: ContextVar[TenantAccount | None] = ContextVar("tokenmill_tenant_account", default=None)
DEFAULT_TENANT = Tenant("default", ())  # every request's, where no tenants file names them


def authenticate(tenancy: Tenancy, authorization: str | None) -> TenantAccount:
    scheme, _, key = (authorization or "").partition(" ")
    account = tenancy.account_for(key.strip()) if scheme.lower() == "bearer" else None
    if account is None:
        raise APIError(401, "invalid or missing API key: send a tenant's key as 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return account


@contextmanager
def admitted(account: TenantAccount) -> Iterator[None]:
    """The request within its tenant's quotas (APIError 429 otherwise), charged to it meanwhile."""
    refusal = account.admit()
    if refusal is not None:
        raise quota_error(refusal)
    token = current_account.set(account)
    try:
        yield
    finally:
        current_account.reset(token)
        account.release()


def quota_error(refusal: Refusal) -> APIError:
    return APIError(429, refusal.message, "rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(refusal.retry_after_s)))})


@dataclass(slots=True)
class FleetSlot:
    queue: FairQueue
    slot: Slot

    def release(self, used_tokens: int) -> None:
        """The stream is over (once; again changes nothing), having used these tokens."""
        self.queue.release(self.slot, used_tokens)


class FleetQueue:
    def __init__(self, max_in_flight: int, timeout_s: float | None) -> None:
        self.fair = FairQueue(max_in_flight)
        self.timeout_s = timeout_s

    async def acquire(self, cost: int) -> FleetSlot:
        """A slot for a stream of about `cost` tokens (prompt + max_tokens), for the request's tenant."""
        account = current_account.get()
        try:
            slot = await self.fair.acquire(DEFAULT_TENANT if account is None else account.tenant, cost,
                                           self.timeout_s)
        except QueueTimeout as exc:
            raise APIError(503, f"{exc} (--queue-timeout-s); retry later", SERVER_ERROR, code="queue_timeout",
                           headers={"Retry-After": "1"}) from exc
        return FleetSlot(self.fair, slot)
