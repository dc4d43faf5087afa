"""The dashboard against a real `tokenmill serve` (two workers, a host KV tier, an admin key):
every admin action refuses bad input naming the field and answers 401 without the key; the
stream's figures are what `/metrics` says over the same window; and toggling the cache, the
routing and disaggregation under load fails or cuts no request."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving.browser import dashboard_page
from tests.serving.conftest import Server, start_server, stop_server
from tokenmill.api.dashboard.figures import snapshot, window

KEY = "dashboard-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_dense, tmp_path_factory.mktemp("dashboard"), "--kv-cache-blocks", "128",
                          "--kv-host-gb", "0.05", "--admin-api-key", KEY, "--usd-per-worker-hour", "2",
                          workers=2)
    try:
        yield server
    finally:
        stop_server(server)


def post(server: Server, path: str, body: Any, headers: dict[str, str] | None = AUTH) -> httpx.Response:
    return httpx.post(server.url + path, content=json.dumps(body), headers=headers, timeout=30, trust_env=False)


def get(server: Server, path: str, headers: dict[str, str] | None = AUTH) -> httpx.Response:
    return httpx.get(server.url + path, headers=headers, timeout=30, trust_env=False)


def complete(server: Server, seed: int, max_tokens: int = 8) -> httpx.Response:
    prompt = [3 + (seed * 7 + i) % 500 for i in range(40 + seed % 50)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120, trust_env=False)


def test_admin_actions_need_the_key_and_refuse_bad_input_naming_the_field(server: Server) -> None:
    for method, path in (("GET", "/admin/settings"), ("POST", "/admin/settings"), ("GET", "/admin/scenarios"),
                         ("POST", "/admin/scenarios")):
        reply = httpx.request(method, server.url + path, json={}, trust_env=False)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key", (method, path)
    cases = [("/admin/settings", {"turbo": True}, 400, "turbo"),
             ("/admin/settings", {"managed_cache": "no"}, 400, "managed_cache"),
             ("/admin/settings", {"planner": False}, 409, "planner"),
             ("/admin/scenarios", {"action": "go", "scenario": "risk"}, 400, "action"),
             ("/admin/scenarios", {"action": "start", "scenario": "poker"}, 400, "scenario"),
             ("/admin/scenarios", {"action": "start", "scenario": "risk", "rate": 0}, 400, "rate"),
             ("/admin/scenarios", {"action": "start", "scenario": "trial", "seed": -2}, 400, "seed"),
             ("/admin/scenarios", {"action": "start", "scenario": "trace"}, 400, "path"),
             ("/admin/scenarios", {"action": "start", "scenario": "trace", "path": "/nowhere.jsonl"}, 400, "path"),
             ("/admin/scenarios", {"action": "start", "scenario": "trace", "path": "x.csv", "rate_scale": 0}, 400,
              "rate_scale")]
    for path, body, status, param in cases:
        reply = post(server, path, body)
        assert reply.status_code == status and reply.json()["error"]["param"] == param, (body, reply.text)
    assert post(server, "/admin/settings", "[1, 2]").status_code == 400
    reply = get(server, "/dashboard/events?window_s=0", headers=None)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "window_s"
    page = get(server, "/dashboard", headers=None)
    assert page.status_code == 200 and "EventSource" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere: no CDN
    assert get(server, "/admin/scenarios").json()["risk"]["running"] is False  # nothing was started


def _settled_metrics(server: Server) -> str:
    """/metrics once the workers' counters (which ride their heartbeats) have stopped moving."""
    def workers(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("tokenmill_worker_")]
    last = get(server, "/metrics", headers=None).text
    for _ in range(30):
        time.sleep(1.0)
        text = get(server, "/metrics", headers=None).text
        if workers(text) == workers(last):
            return text
        last = text
    raise AssertionError("the workers' counters never settled")


def _points(server: Server, window_s: float, after_t: float) -> dict[str, Any]:
    """The first point the stream sends that ends after `after_t`."""
    with httpx.stream("GET", f"{server.url}/dashboard/events?window_s={window_s}", timeout=30,
                      trust_env=False) as reply:
        event = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "point":
                point = json.loads(line[6:])
                if point["t"] > after_t:
                    return point
    raise AssertionError("the stream ended")


def test_the_stream_says_what_metrics_says_over_the_same_window(server: Server) -> None:
    """Quiet, /metrics; 3 s quiet; six requests; quiet again, /metrics. A point whose window
    starts in the first quiet stretch and ends after the second /metrics saw exactly what the
    two scrapes saw between them."""
    before_text = _settled_metrics(server)
    t0 = time.time()
    time.sleep(3.0)
    for seed in range(6):
        assert complete(server, seed).status_code == 200
    after_text = _settled_metrics(server)
    connected = time.time()
    point = _points(server, window_s=connected - t0 - 1.0, after_t=connected)
    expected = window(snapshot(text_string_to_metric_families(before_text), 0.0),
                      snapshot(text_string_to_metric_families(after_text), 1.0), block_size=16)
    assert expected["output_tokens"] == 6 * 8  # every token, once
    for key in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "output_tokens", "in_flight", "queued",
                "prompt_tokens_looked_up", "prefill_computed_tokens", "prefill_reused_tokens"):
        assert point[key] == pytest.approx(expected[key]), key
    assert point["workers"] == expected["workers"] == {"agg": {"starting": 0, "serving": 2, "draining": 0}}
    assert point["hit_rate"] == pytest.approx(expected["hit_rate"])
    assert expected["prefill_computed_tokens"] > 0 and expected["prompt_tokens_looked_up"] > 0


def _wait_settings(server: Server, done: Any, timeout_s: float = 90.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = get(server, "/admin/settings").json()
        if done(state):
            return state
        time.sleep(0.3)
    raise AssertionError(f"settings never reached the wanted state: {state}")


def _serving(server: Server) -> dict[str, int]:
    workers = get(server, "/admin/workers").json()["data"]
    out: dict[str, int] = {}
    for w in workers:
        if w["state"] == "serving":
            out[w["role"]] = out.get(w["role"], 0) + 1
    return out


def test_toggles_under_load_lose_no_request(server: Server) -> None:
    """The trial scenario runs server-side while four clients send requests; the cache goes off
    and on, routing round-robin and back, disaggregation on and off: every request succeeds whole."""
    assert post(server, "/admin/scenarios", {"action": "start", "scenario": "trial", "rate": 4.0}).status_code == 200
    replies: list[httpx.Response] = []
    stop = threading.Event()

    def client(offset: int) -> None:
        seed = offset
        while not stop.is_set():
            replies.append(complete(server, seed, max_tokens=16))
            seed += 4
    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for thread in clients:
        thread.start()
    try:
        for body in ({"managed_cache": False}, {"managed_cache": True}, {"kv_routing": False}, {"kv_routing": True}):
            assert post(server, "/admin/settings", body).json()[next(iter(body))] is next(iter(body.values()))
            time.sleep(1.5)
        assert post(server, "/admin/settings", {"disaggregation": True}).status_code == 200
        state = _wait_settings(server, lambda s: s["busy"] is None)
        assert state["disaggregation"] is True and state["last_error"] is None
        assert _serving(server) == {"prefill": 1, "decode": 1}
        time.sleep(2.0)
        assert post(server, "/admin/settings", {"disaggregation": False}).status_code == 200
        state = _wait_settings(server, lambda s: s["busy"] is None)
        assert state["disaggregation"] is False and _serving(server) == {"agg": 2}
        time.sleep(1.0)
    finally:
        stop.set()
        for thread in clients:
            thread.join()
        post(server, "/admin/scenarios", {"action": "stop", "scenario": "trial"})
    assert replies and all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 16 for r in replies)
    trial = get(server, "/admin/scenarios").json()["trial"]
    assert trial["succeeded"] > 10 and trial["failed"] == 0, trial


def _latest(page: Any) -> dict[str, Any]:
    return page.evaluate("() => points.length ? points[points.length - 1] : null") or {}


def _wait_page(page: Any, what: str, ok: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        point = _latest(page)
        if point and ok(point):
            return point
        page.wait_for_timeout(250)
    raise AssertionError(f"the page never showed {what}; last point {_latest(page)}")


def test_the_page_in_a_real_browser_follows_the_toggles(server: Server, tmp_path: Path) -> None:
    """Debian's chromium driven by Playwright: no console errors; the charts fill once the trial
    scenario starts; with the managed cache off the host tier's hits fall to zero and more prefill
    is computed, on again they return; disaggregation on shows prefill and decode workers."""
    with dashboard_page(server.url, viewport={"width": 1400, "height": 1000}) as (page, errors):
        page.fill("#key", KEY)
        assert not page.is_visible("#tenants-box")  # no --tenants: no table, and no request for one
        page.dispatch_event("#key", "change")
        page.eval_on_selector("#rate-trial", "el => { el.value = '3'; }")
        page.click("#scenario-trial")
        _wait_page(page, "tokens flowing", lambda p: p["output_tokens_per_s"] > 0)
        first = _wait_page(page, "host-tier hits", lambda p: (p["hit_rate"] or {}).get("host", 0) > 0)
        # compared with a window wholly in the warm state (the opening one computes every corpus)
        on = _wait_page(page, "a warm window with host-tier hits",
                        lambda p: p["t"] - p["window_s"] > first["t"] and (p["hit_rate"] or {}).get("host", 0) > 0)
        page.click("#toggle-managed_cache")
        clicked = time.time()
        off = _wait_page(page, "no host-tier hits a window after the cache went off",
                         lambda p: p["t"] - p["window_s"] > clicked + 1 and p["hit_rate"] is not None)
        assert off["hit_rate"]["host"] == 0.0
        assert off["prefill_computed_tokens"] / max(off["prompt_tokens_looked_up"], 1) > \
            on["prefill_computed_tokens"] / max(on["prompt_tokens_looked_up"], 1)
        assert page.inner_text("#toggle-managed_cache").endswith("off")
        page.click("#toggle-managed_cache")
        _wait_page(page, "host-tier hits again", lambda p: (p["hit_rate"] or {}).get("host", 0) > 0)
        page.click("#toggle-disaggregation")
        page.wait_for_function("() => document.getElementById('workers').textContent.includes('prefill 1')"
                               " && document.getElementById('workers').textContent.includes('decode 1')",
                               timeout=90_000)
        assert page.evaluate("() => markers.map(m => m.label)")[-1].startswith("disaggregation on")
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        page.click("#scenario-trial")  # stop
    assert not errors, errors
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
