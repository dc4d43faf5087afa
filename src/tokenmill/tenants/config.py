"""The tenants file (`--tenants FILE`, TOML): one table per tenant.

    [tenants.assistant]
    keys = ["k-assistant"]      # its API keys (Bearer): at least one, none shared with another tenant
    class = "interactive"       # interactive | standard (the default) | batch
    weight = 1.0                # its share within its class (> 0; default 1)
    requests_per_s = 20         # optional quotas, each > 0: requests admitted per second,
    tokens_per_min = 200000     #   prompt + output tokens per minute,
    max_concurrent = 8          #   requests in flight at once

    tenants = load_tenants("tenants.toml")   # ValueError naming the file and the field
    tenants.by_key("k-assistant")            # that Tenant; None for a key of no tenant

Keys are looked up by their SHA-256, so the lookup's timing says nothing about a key's text.
"""
from __future__ import annotations

import hashlib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLASSES = ("interactive", "standard", "batch")  # highest priority first
FIELDS = ("keys", "class", "weight", "requests_per_s", "tokens_per_min", "max_concurrent")
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e6  # shares far outside these are a typo, and would overflow the fair queue


@dataclass(slots=True, frozen=True)
class Quotas:
    requests_per_s: float | None = None
    tokens_per_min: int | None = None
    max_concurrent: int | None = None


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    keys: tuple[str, ...]
    priority_class: str = "standard"
    weight: float = 1.0
    quotas: Quotas = Quotas()

    @property
    def priority(self) -> int:
        """Its requests' priority in the engine (lower is more urgent): interactive -1, standard 0,
        batch 1; a request without a tenant has 0."""
        return CLASSES.index(self.priority_class) - 1


@dataclass(slots=True, frozen=True)
class Tenants:
    path: str
    tenants: tuple[Tenant, ...]
    _by_digest: dict[bytes, Tenant] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for tenant in self.tenants:
            for key in tenant.keys:
                self._by_digest[_digest(key)] = tenant

    def by_key(self, key: str) -> Tenant | None:
        return self._by_digest.get(_digest(key))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_tenants(path: str | Path) -> Tenants:
    """The file's tenants; ValueError naming the file and the field at the first mistake."""
    where = f"--tenants {path}"
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it ({exc.strerror or exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where}: not TOML ({exc})") from exc
    extra = sorted(set(document) - {"tenants"})
    if extra:
        raise ValueError(f"{where}: {extra[0]}: unknown table (the file holds [tenants.NAME] tables only)")
    tables = document.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"{where}: tenants: no tenant (write one [tenants.NAME] table each)")
    tenants = tuple(_tenant(where, name, table) for name, table in tables.items())
    seen: dict[str, str] = {}
    for tenant in tenants:
        for key in tenant.keys:
            if key in seen:
                raise ValueError(f"{where}: tenants.{tenant.name}.keys: a key of tenants.{seen[key]} too")
            seen[key] = tenant.name
    return Tenants(str(path), tenants)


def _sendable(key: str) -> bool:
    return bool(key) and all("!" <= c <= "~" for c in key)


def _tenant(where: str, name: str, table: Any) -> Tenant:
    at = f"{where}: tenants.{name}"
    if not name.strip():
        raise ValueError(f"{where}: tenants: a tenant needs a name ([tenants.NAME])")
    if not isinstance(table, dict):
        raise ValueError(f"{at}: must be a table ([tenants.{name}])")
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise ValueError(f"{at}.{unknown[0]}: unknown field (known: {', '.join(FIELDS)})")
    keys = table.get("keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and _sendable(k) for k in keys):
        raise ValueError(f"{at}.keys: must be a list of at least one key, each printable ASCII without spaces "
                         "(what an Authorization header carries)")
    if len(set(keys)) != len(keys):
        raise ValueError(f"{at}.keys: a key is listed twice")
    priority_class = table.get("class", "standard")
    if priority_class not in CLASSES:
        raise ValueError(f"{at}.class: must be one of {', '.join(CLASSES)}, got {priority_class!r}")
    quotas = Quotas(_positive(at, table, "requests_per_s", float), _positive(at, table, "tokens_per_min", int),
                    _positive(at, table, "max_concurrent", int))
    weight = _positive(at, table, "weight", float) or 1.0
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise ValueError(f"{at}.weight: must be between {MIN_WEIGHT:g} and {MAX_WEIGHT:g}, got {weight:g}")
    return Tenant(name, tuple(keys), priority_class, weight, quotas)


def _positive(at: str, table: dict, name: str, kind: type) -> Any:
    """The field's value (None when absent): a finite number > 0, a whole one where `kind` is int."""
    value = table.get(name)
    if value is None:
        return None
    whole = kind is int
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{at}.{name}: must be {'a whole number' if whole else 'a number'} > 0, got {value!r}")
    return kind(value)
