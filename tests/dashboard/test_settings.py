"""`/admin/settings` without processes: the body is checked whole before anything changes (a 400
naming the field), a toggle the deployment cannot honour is a 409 naming it, and the routing
and cache switches act on the routers and on every worker, later ones included."""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from tokenmill.api.dashboard.settings import Settings
from tokenmill.api.errors import APIError
from tokenmill.fleet.worker_pool import WorkerPool
from tokenmill.router.decision import RoutingRequest
from tokenmill.router.policies import Router, RouterConfig
from tokenmill.runtime import protocol as p
from tokenmill.runtime.discovery import MemoryDiscovery


@dataclass
class FakeConnection:
    load: dict[str, float]
    sent: list[dict[str, Any]] = field(default_factory=list)

    def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


@dataclass
class FakeBackend:
    pool: WorkerPool


def _settings(tiers: bool = True, policy: str = "kv", api_servers: int = 1) -> tuple[Settings, list[str]]:
    router = Router(RouterConfig(policy), random.Random(0))
    for worker in ("w0", "w1"):
        router.add_worker(worker)
    load = {"tier_host_hits": 0.0} if tiers else {}
    pool = WorkerPool(MemoryDiscovery(), router, prefill_router=Router(RouterConfig("kv")))
    pool.connections.update({"w0": FakeConnection(dict(load)), "w1": FakeConnection(dict(load))})  # type: ignore[dict-item]
    marks: list[str] = []
    return Settings(FakeBackend(pool), None, lambda: None, marks.append, api_servers), marks


def _apply(settings: Settings, body: Any) -> dict[str, Any]:
    return asyncio.run(settings.apply(body))


@pytest.mark.parametrize("body,param", [
    ([], None), ({}, None), ({"kv_routing": "off"}, "kv_routing"), ({"kv_routing": 0}, "kv_routing"),
    ({"managed_cache": True, "turbo": True}, "turbo"),
])
def test_a_bad_body_is_a_400_naming_the_field_and_changes_nothing(body: Any, param: str | None) -> None:
    settings, marks = _settings()
    with pytest.raises(APIError) as caught:
        _apply(settings, body)
    assert caught.value.status == 400 and caught.value.detail.param == param
    assert settings.describe()["managed_cache"] is True and not marks


@pytest.mark.parametrize("body,kwargs,param", [
    ({"disaggregation": True}, {}, "disaggregation"),  # no worker control: not `tokenmill serve`
    ({"planner": False}, {}, "planner"),
    ({"managed_cache": False}, {"tiers": False}, "managed_cache"),
    ({"kv_routing": True}, {"policy": "round-robin"}, "kv_routing"),  # launched without a KV index
    ({"kv_routing": False}, {"api_servers": 2}, "kv_routing"),
])
def test_a_toggle_the_deployment_cannot_honour_is_a_409_naming_it(body: dict, kwargs: dict, param: str) -> None:
    settings, _ = _settings(**kwargs)
    with pytest.raises(APIError) as caught:
        _apply(settings, body)
    assert caught.value.status == 409 and caught.value.detail.param == param
    assert settings.describe()[param] in (None, True)


def test_routing_and_cache_switches_act_on_routers_and_workers() -> None:
    settings, marks = _settings()
    router = settings.backend.pool.router
    state = _apply(settings, {"kv_routing": False, "managed_cache": False})
    assert (state["kv_routing"], state["managed_cache"]) == (False, False)
    picks = [router.select(RoutingRequest(f"r{i}", [7, 8], 40)).worker for i in range(4)]
    assert picks == ["w0", "w1", "w0", "w1"]  # round robin now
    off = {"type": p.TIERS, "enabled": False}
    assert all(conn.sent == [off] for conn in settings.backend.pool.connections.values())
    assert settings.backend.pool.join_messages == [off]  # a worker that joins later is told too
    assert router.config.cost.tier_weights["host"] == 0.0 and router.config.cost.tier_weights["device"] == 1.0
    state = _apply(settings, {"kv_routing": True, "managed_cache": True})
    assert router.policy == "kv" and router.config.cost.tier_weights["host"] > 0
    assert marks == ["KV routing off", "managed cache off", "KV routing on", "managed cache on"]
    _apply(settings, {"managed_cache": True})  # no change: nothing sent, nothing marked
    assert len(marks) == 4 and len(settings.backend.pool.connections["w0"].sent) == 2
