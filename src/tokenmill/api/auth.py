"""API keys: `Authorization: Bearer <key>` on every `/v1` route, as OpenAI clients send it.

`--api-key` (or `$TOKENMILL_API_KEY`) guards `/v1/*`; `--admin-api-key` (or
`$TOKENMILL_ADMIN_API_KEY`) guards `/admin/*`, which without one of its own takes the API key.
`/health` and `/metrics` stay open: probes and scrapers carry no keys. Without any key nothing
is guarded, except that `/admin/*` without a key answers loopback clients only (403 for others):
it starts and stops processes. A missing or wrong key is a 401 OpenAI error (`invalid_api_key`);
keys are compared in constant time.
"""
from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where raised: `serve` reads the key variables before it refuses a flag
    from tokenmill.api.errors import APIError

API_KEY_ENV, ADMIN_API_KEY_ENV = "TOKENMILL_API_KEY", "TOKENMILL_ADMIN_API_KEY"


@dataclass(slots=True, frozen=True)
class ApiKeys:
    api: str | None = None
    admin: str | None = None

    @classmethod
    def resolve(cls, api: str | None, admin: str | None) -> ApiKeys:
        """Flags first, then the environment; an empty key is no key."""
        return cls(api or os.environ.get(API_KEY_ENV) or None, admin or os.environ.get(ADMIN_API_KEY_ENV) or None)

    def required_for(self, path: str) -> str | None:
        if path.startswith("/admin/"):
            return self.admin or self.api
        if path == "/v1" or path.startswith("/v1/"):
            return self.api
        return None

    def check_origin(self, path: str, client_host: str | None) -> None:
        """Raises the 403 when an unguarded `/admin` route is asked from off this host."""
        if not path.startswith("/admin/") or self.required_for(path) is not None or _loopback(client_host):
            return
        from tokenmill.api.errors import APIError

        raise APIError(403, "admin routes without --admin-api-key answer only on loopback", code="forbidden")

    def check(self, path: str, authorization: str | None) -> None:
        """Raises the 401 when `path` needs a key and the header does not carry it."""
        key = self.required_for(path)
        if key is None:
            return
        given = bearer_key(authorization)
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            raise invalid_key("invalid or missing API key: send it as 'Authorization: Bearer <key>'")


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header; None for another scheme or none."""
    scheme, _, given = (authorization or "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


def invalid_key(message: str) -> APIError:
    from tokenmill.api.errors import APIError

    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _loopback(host: str | None) -> bool:
    if host is None:  # no peer address: an in-process transport
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
