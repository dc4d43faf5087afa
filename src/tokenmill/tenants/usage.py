"""What each tenant used: Prometheus counters (`tokenmill_tenant_*`, labelled by tenant) and the
table `GET /admin/tenants` shows.

    tenancy = Tenancy(load_tenants(path), registry)
    account = tenancy.account_for(key)      # None: no tenant holds that key
    refusal = account.admit()               # quotas.py's Refusal (counted by quota), or None
    account.finished("success", prompt_tokens=12, output_tokens=30, cached_tokens=4,  # each stream
                     step_seconds=0.8)      # the workers' step time its tokens caused
    account.release()                       # the request is over
    tenancy.table()                         # per tenant: class, weight, quotas, in flight, tallies

Cost: every engine step's time is shared out over the sequences in it by the tokens each computed
(a prompt chunk's tokens, a decode's one token and its drafts), and each output reports its share
(`RequestOutput.step_seconds`). A tenant's worker-seconds are the sum of its streams' shares, and
its dollars those seconds at the worker-hour price (`--usd-per-worker-hour`): the cost its tokens
caused. The time workers sit idle is nobody's (it is in the fleet's own cost per million tokens).
A vLLM worker does not report step time: its tenants' worker-seconds stay 0.

A stream that reached the engine counts as the frontend's own `tokenmill_requests_total` and
token counters count it. A request refused before any stream opened (its quota, the queue's
timeout, the fleet's overload, a bad field) is in no tenant's `requests` (its quota refusals are in
`refused`).
"""
from __future__ import annotations

from collections import Counter as Tally
from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenmill.tenants.config import Tenant, Tenants
from tokenmill.tenants.quotas import QuotaGate, Refusal


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter("tokenmill_tenant_requests", "finished requests by tenant and outcome",
                                ["tenant", "class", "status"], registry=r)
        self.refused = Counter("tokenmill_tenant_refused_requests", "requests refused by a tenant's quota",
                               ["tenant", "quota"], registry=r)
        self.input_tokens = Counter("tokenmill_tenant_input_tokens", "prompt tokens", ["tenant"], registry=r)
        self.cached_tokens = Counter("tokenmill_tenant_cached_tokens", "prompt tokens served from a prefix cache",
                                     ["tenant"], registry=r)
        self.output_tokens = Counter("tokenmill_tenant_output_tokens", "generated tokens", ["tenant"], registry=r)
        self.worker_seconds = Counter("tokenmill_tenant_worker_seconds", "workers' step time its tokens caused",
                                      ["tenant"], registry=r)
        self.usd = Counter("tokenmill_tenant_usd", "its worker-seconds at the worker-hour price", ["tenant"],
                           registry=r)
        self.in_flight = Gauge("tokenmill_tenant_requests_in_flight", "requests admitted and not yet over",
                               ["tenant"], registry=r)


class TenantAccount:
    def __init__(self, tenant: Tenant, metrics: TenantMetrics, usd_per_worker_hour: float = 0.0) -> None:
        self.tenant, self.metrics, self.usd_per_worker_hour = tenant, metrics, usd_per_worker_hour
        self.gate = QuotaGate(tenant.name, tenant.quotas)
        self.requests: Tally[str] = Tally()
        self.refused: Tally[str] = Tally()
        self.tokens: Tally[str] = Tally()  # input, cached, output
        self.worker_seconds = 0.0

    def admit(self) -> Refusal | None:
        refusal = self.gate.admit()
        if refusal is None:
            self.metrics.in_flight.labels(tenant=self.tenant.name).inc()
        else:
            self.refused[refusal.quota] += 1
            self.metrics.refused.labels(tenant=self.tenant.name, quota=refusal.quota).inc()
        return refusal

    def finished(self, status: str, prompt_tokens: int, output_tokens: int, cached_tokens: int,
                 step_seconds: float = 0.0) -> None:
        name, m = self.tenant.name, self.metrics
        self.worker_seconds += step_seconds
        m.worker_seconds.labels(tenant=name).inc(step_seconds)
        m.usd.labels(tenant=name).inc(step_seconds * self.usd_per_worker_hour / 3600)
        self.requests[status] += 1
        self.tokens.update(input=prompt_tokens, cached=cached_tokens, output=output_tokens)
        m.requests.labels(tenant=name, **{"class": self.tenant.priority_class}, status=status).inc()
        m.input_tokens.labels(tenant=name).inc(prompt_tokens)
        m.cached_tokens.labels(tenant=name).inc(cached_tokens)
        m.output_tokens.labels(tenant=name).inc(output_tokens)
        self.gate.charge(prompt_tokens + output_tokens)

    def release(self) -> None:
        self.gate.release()
        self.metrics.in_flight.labels(tenant=self.tenant.name).dec()

    def row(self) -> dict[str, Any]:
        t = self.tenant
        return {"name": t.name, "class": t.priority_class, "weight": t.weight,
                "quotas": {k: v for k, v in asdict(t.quotas).items() if v is not None},
                "in_flight": self.gate.in_flight, "requests": dict(self.requests), "refused": dict(self.refused),
                "input_tokens": self.tokens["input"], "cached_tokens": self.tokens["cached"],
                "output_tokens": self.tokens["output"], "worker_seconds": self.worker_seconds,
                "usd": self.worker_seconds * self.usd_per_worker_hour / 3600}


class Tenancy:
    def __init__(self, tenants: Tenants, registry: CollectorRegistry, usd_per_worker_hour: float = 0.0) -> None:
        self.tenants = tenants
        metrics = TenantMetrics(registry)
        self.accounts = {t.name: TenantAccount(t, metrics, usd_per_worker_hour) for t in tenants.tenants}

    def account_for(self, key: str) -> TenantAccount | None:
        tenant = self.tenants.by_key(key)
        return None if tenant is None else self.accounts[tenant.name]

    def table(self) -> list[dict[str, Any]]:
        return [account.row() for account in self.accounts.values()]
