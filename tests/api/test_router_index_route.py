"""`GET /admin/router/index` where no router runs: one embedded engine answers 404, in the
OpenAI error shape. (The view itself: tests/router/test_index_view.py; two frontends compared
block for block through it: tests/serving/test_nats_events.py.)"""
from __future__ import annotations

import httpx

from tests.api.conftest import Served


def test_an_embedded_engine_has_no_router_to_show(server: Served) -> None:
    reply = httpx.get(f"{server.url}/admin/router/index", timeout=30)
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "not_found"
    assert "no KV router" in reply.json()["error"]["message"]
