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
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.tenants.config import Tenant, Tenants
from tokenmill.tenants.quotas import QuotaGate, Refusal


class TenantAccount:
    """One tenant's quota gate and tallies (the one record its metrics and its table row read)."""

    def __init__(self, tenant: Tenant, usd_per_worker_hour: float = 0.0) -> None:
        self.tenant, self.usd_per_worker_hour = tenant, usd_per_worker_hour
        self.gate = QuotaGate(tenant.name, tenant.quotas)
        self.requests: Tally[str] = Tally()  # by outcome
        self.refused: Tally[str] = Tally()  # by quota
        self.tokens: Tally[str] = Tally()  # input, cached, output
        self.worker_seconds = 0.0

    @property
    def usd(self) -> float:
        return self.worker_seconds * self.usd_per_worker_hour / 3600

    def admit(self) -> Refusal | None:
        refusal = self.gate.admit()
        if refusal is not None:
            self.refused[refusal.quota] += 1
        return refusal

    def finished(self, status: str, prompt_tokens: int, output_tokens: int, cached_tokens: int,
                 step_seconds: float = 0.0) -> None:
        self.requests[status] += 1
        self.tokens.update(input=prompt_tokens, cached=cached_tokens, output=output_tokens)
        self.worker_seconds += step_seconds
        self.gate.charge(prompt_tokens + output_tokens)

    def release(self) -> None:
        self.gate.release()

    def row(self) -> dict[str, Any]:
        t = self.tenant
        return {"name": t.name, "class": t.priority_class, "weight": t.weight,
                "quotas": {k: v for k, v in asdict(t.quotas).items() if v is not None},
                "in_flight": self.gate.in_flight, "requests": dict(self.requests), "refused": dict(self.refused),
                "input_tokens": self.tokens["input"], "cached_tokens": self.tokens["cached"],
                "output_tokens": self.tokens["output"], "worker_seconds": self.worker_seconds, "usd": self.usd}


class Tenancy:
    def __init__(self, tenants: Tenants, registry: CollectorRegistry, usd_per_worker_hour: float = 0.0) -> None:
        self.tenants = tenants
        self.accounts = {t.name: TenantAccount(t, usd_per_worker_hour) for t in tenants.tenants}
        registry.register(_TenantCollector(self.accounts))

    def account_for(self, key: str) -> TenantAccount | None:
        tenant = self.tenants.by_key(key)
        return None if tenant is None else self.accounts[tenant.name]

    def table(self) -> list[dict[str, Any]]:
        return [account.row() for account in self.accounts.values()]


class _TenantCollector(Collector):
    """The accounts' tallies as `tokenmill_tenant_*` series, read at scrape time."""

    def __init__(self, accounts: dict[str, TenantAccount]) -> None:
        self.accounts = accounts

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("tokenmill_tenant_requests", "finished requests by tenant and outcome",
                                       labels=["tenant", "class", "status"])
        refused = CounterMetricFamily("tokenmill_tenant_refused_requests", "requests refused by a tenant's quota",
                                      labels=["tenant", "quota"])
        per_tenant = {
            "input": CounterMetricFamily("tokenmill_tenant_input_tokens", "prompt tokens", labels=["tenant"]),
            "cached": CounterMetricFamily("tokenmill_tenant_cached_tokens", "prompt tokens served from a prefix "
                                          "cache", labels=["tenant"]),
            "output": CounterMetricFamily("tokenmill_tenant_output_tokens", "generated tokens", labels=["tenant"])}
        seconds = CounterMetricFamily("tokenmill_tenant_worker_seconds", "workers' step time its tokens caused",
                                      labels=["tenant"])
        usd = CounterMetricFamily("tokenmill_tenant_usd", "its worker-seconds at the worker-hour price",
                                  labels=["tenant"])
        in_flight = GaugeMetricFamily("tokenmill_tenant_requests_in_flight", "requests admitted and not yet over",
                                      labels=["tenant"])
        for name, account in self.accounts.items():
            for status, count in account.requests.items():
                requests.add_metric([name, account.tenant.priority_class, status], count)
            for quota, count in account.refused.items():
                refused.add_metric([name, quota], count)
            for kind, family in per_tenant.items():
                family.add_metric([name], account.tokens[kind])
            seconds.add_metric([name], account.worker_seconds)
            usd.add_metric([name], account.usd)
            in_flight.add_metric([name], account.gate.in_flight)
        yield from (requests, refused, *per_tenant.values(), seconds, usd, in_flight)
