"""Tenants at the HTTP edge (`serve/frontend --tenants FILE`, `tenants/`): a `/v1` request names
its tenant by its key (401 for a key no tenant holds), a generation request passes its tenant's
quotas (429 with `Retry-After` and a message naming the quota) and its streams are charged to
that tenant.

The request's account travels with its task (`current_account`, set here for the request's
lifetime): every stream it opens, `n` choices included, is charged by the frontend's own request
bookkeeping (`metrics.RequestTimer`) without each route passing it on.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from tokenmill.api.errors import APIError
from tokenmill.tenants.quotas import Refusal
from tokenmill.tenants.usage import Tenancy, TenantAccount

current_account: ContextVar[TenantAccount | None] = ContextVar("tokenmill_tenant_account", default=None)


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
