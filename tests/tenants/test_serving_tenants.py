"""Tenants over a real `tokenmill serve` (mock runner): keys name tenants, quotas answer 429 with
Retry-After naming the quota, and the per-tenant counters and `/admin/tenants` match what was sent."""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from tests.serving.browser import dashboard_page
from tests.serving.conftest import Server, start_server, stop_server
from tests.serving.probes import metric
from tokenmill.api.launch import add_frontend_flags, tenants_from

# an interactive and a batch tenant; the first module server caps the batch one at one request
# in flight and adds a tenant allowed one request in a thousand seconds
QUEUED = """
[tenants.assistant]
keys = ["k-assistant"]
class = "interactive"

[tenants.sweeps]
keys = ["k-sweeps"]
class = "batch"
"""
TENANTS = QUEUED + """max_concurrent = 1

[tenants.trickle]
keys = ["k-trickle"]
requests_per_s = 0.001
"""


def _serving(model: Path, run_dir: Path, tenants: str, *flags: str) -> Iterator[Server]:
    """A mock worker (10 ms a step) behind a frontend with these tenants, stopped after."""
    (run_dir / "tenants.toml").write_text(tenants)
    served = start_server(model, run_dir, "--runner", "mock", "--mock-step-time", "0.01,0,0,0",
                          "--tenants", str(run_dir / "tenants.toml"), *flags)
    try:
        yield served
    finally:
        stop_server(served)


@pytest.fixture(scope="module")
def server(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serving(tiny_dense, tmp_path_factory.mktemp("tenants"), TENANTS, "--usd-per-worker-hour", "3.6")


def _complete(server: Server, key: str | None, prompt: list[int], max_tokens: int) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/completions", headers=headers, timeout=60, trust_env=False,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


def test_only_a_tenants_key_reaches_v1(server: Server) -> None:
    for key in (None, "k-nobody"):
        refused = _complete(server, key, [5, 6, 7], 2)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k-assistant"}, timeout=10,
                       trust_env=False)
    assert models.status_code == 200
    assert httpx.get(server.url + "/health", timeout=10, trust_env=False).status_code == 200


def test_quotas_refuse_with_429_naming_them_and_counters_match_what_was_sent(server: Server) -> None:
    headers = {"Authorization": "Bearer k-sweeps"}
    body = {"model": "tiny", "prompt": [9, 10, 11, 12], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", headers=headers, json=body, timeout=60,
                      trust_env=False) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # admitted and generating
        busy = _complete(server, "k-sweeps", [9, 10], 2)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        error = busy.json()["error"]
        assert error["type"] == "rate_limit_error" and "'sweeps' is over its max_concurrent quota (1" in error["message"]
        prompts = [[20 + i] * (3 + i) for i in range(3)]
        served = [_complete(server, "k-assistant", p, 5 + i) for i, p in enumerate(prompts)]  # not held up
        assert [r.status_code for r in served] == [200] * 3
        list(lines)  # the stream to its end
    assert _complete(server, "k-sweeps", [9, 10], 2).status_code == 200  # its slot is free again
    assert _complete(server, "k-trickle", [3, 4], 2).status_code == 200
    slow = _complete(server, "k-trickle", [3, 4], 2)
    assert slow.status_code == 429 and int(slow.headers["retry-after"]) >= 999
    assert "requests_per_s quota" in slow.json()["error"]["message"]

    url = server.url
    assert metric(url, "tokenmill_tenant_requests_total", tenant="assistant", status="success") == 3
    assert metric(url, "tokenmill_tenant_input_tokens_total", tenant="assistant") == sum(map(len, prompts))
    assert metric(url, "tokenmill_tenant_output_tokens_total", tenant="assistant") == 5 + 6 + 7
    assert metric(url, "tokenmill_tenant_requests_total", tenant="sweeps", status="success") == 2
    assert metric(url, "tokenmill_tenant_output_tokens_total", tenant="sweeps") == 400 + 2
    assert metric(url, "tokenmill_tenant_refused_requests_total", tenant="sweeps", quota="max_concurrent") == 1
    assert metric(url, "tokenmill_tenant_refused_requests_total", tenant="trickle", quota="requests_per_s") == 1
    assert metric(url, "tokenmill_tenant_requests_in_flight", tenant="sweeps") == 0

    rows = {row["name"]: row for row in httpx.get(url + "/admin/tenants", timeout=10, trust_env=False).json()["data"]}
    assert rows["assistant"]["class"] == "interactive" and rows["assistant"]["requests"] == {"success": 3}
    assert rows["sweeps"]["quotas"] == {"max_concurrent": 1}
    assert rows["sweeps"]["refused"] == {"max_concurrent": 1} and rows["sweeps"]["output_tokens"] == 402
    assert rows["trickle"]["in_flight"] == 0 and rows["trickle"]["refused"] == {"requests_per_s": 1}
    # cost: the worker's step time each tenant's tokens caused, at $3.60 a worker-hour ($0.001 a second);
    # sweeps computed 402 tokens to the assistant's 18: more of the steps were its
    for name, row in rows.items():
        seconds = metric(url, "tokenmill_tenant_worker_seconds_total", tenant=name)
        assert row["worker_seconds"] == pytest.approx(seconds) and row["usd"] == pytest.approx(seconds / 1000)
        assert metric(url, "tokenmill_tenant_usd_total", tenant=name) == pytest.approx(seconds / 1000)
    assert rows["sweeps"]["worker_seconds"] > rows["assistant"]["worker_seconds"] > 0


def test_the_dashboard_shows_each_tenants_use_as_admin_tenants_says(server: Server) -> None:
    """Debian's chromium driven by Playwright: the tenants table has a row per tenant whose figures
    are the ones `/admin/tenants` gives (after the requests of the test above, if it ran), and no
    console errors."""
    assert _complete(server, "k-assistant", [7, 8, 9], 3).status_code == 200  # some use to show
    rows = {row["name"]: row for row in
            httpx.get(server.url + "/admin/tenants", timeout=10, trust_env=False).json()["data"]}
    with dashboard_page(server.url) as (page, errors):
        page.wait_for_selector("#tenants tr[data-tenant='trickle']", timeout=60_000)
        cells = page.evaluate("() => Object.fromEntries([...document.querySelectorAll('#tenants tr')].map("
                              "tr => [tr.dataset.tenant, [...tr.children].map(td => td.textContent)]))")
        visible = page.is_visible("#tenants-box")
    assert not errors, errors
    assert visible and sorted(cells) == sorted(rows)
    for name, row in rows.items():
        name_cell, klass, _, _, _, requests, refused, input_tokens, cached, output, _, usd = cells[name]
        assert (name_cell, klass) == (name, row["class"])
        assert int(requests) == sum(row["requests"].values()) and int(refused) == sum(row["refused"].values())
        assert [int(input_tokens), int(cached), int(output)] == [row["input_tokens"], row["cached_tokens"],
                                                               row["output_tokens"]]
        assert usd == f"${row['usd']:.4f}"


def test_serve_refuses_a_bad_tenants_file_naming_the_field(tiny_dense: Path, tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.a]\nkeys = ["k"]\nclass = "gold"\n')
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(tiny_dense), "--port", "0",
                           "--runner", "mock", "--tenants", str(path)], capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "tenants.a.class: must be one of" in lines[0], done.stderr


def test_a_global_api_key_beside_tenants_is_refused_naming_it(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_frontend_flags(parser)
    (tmp_path / "t.toml").write_text('[tenants.a]\nkeys = ["k"]\n')
    with pytest.raises(ValueError, match=r"^--api-key \(or \$TOKENMILL_API_KEY\): with --tenants"):
        tenants_from(parser.parse_args(["--tenants", str(tmp_path / "t.toml"), "--api-key", "secret"]))
    assert tenants_from(parser.parse_args(["--tenants", str(tmp_path / "t.toml")])).tenants[0].name == "a"


@asynccontextmanager
async def _holding_the_slot(client: httpx.AsyncClient, key: str) -> AsyncIterator[None]:
    """A stream far longer than any test (15 s of steps) holds the fleet's one slot until the block
    is left (its generation then cancelled, the slot freed)."""
    body = {"model": "tiny", "prompt": [9, 10], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as stream:
        lines = stream.aiter_lines()
        while not (await anext(lines)).startswith("data:"):  # the one slot is taken
            pass
        yield


@pytest.fixture(scope="module")
def queued_server(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serving(tiny_dense, tmp_path_factory.mktemp("queued"), QUEUED, "--max-in-flight", "1")


def test_a_saturated_fleet_lets_a_waiting_interactive_request_in_before_waiting_batch_ones(
        queued_server: Server) -> None:
    url = queued_server.url

    def waiting() -> dict[str, int]:
        rows = httpx.get(url + "/admin/tenants", timeout=10, trust_env=False).json()["data"]
        return {row["name"]: row["waiting"] for row in rows}

    async def main() -> list[str]:
        done: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as client:
            async def one(key: str, name: str, max_tokens: int) -> None:
                r = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"}, json={
                    "model": "tiny", "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True})
                assert r.status_code == 200, r.text
                done.append(name)

            async def until(condition) -> None:
                for _ in range(300):
                    if condition(await asyncio.to_thread(waiting)):
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"the queue never reached the expected state: {waiting()}")

            async with _holding_the_slot(client, "k-sweeps"):
                batch = [asyncio.create_task(one("k-sweeps", f"sweeps-{i}", 20)) for i in range(4)]
                await until(lambda w: w["sweeps"] == 4)
                interactive = asyncio.create_task(one("k-assistant", "assistant", 5))
                await until(lambda w: w["assistant"] == 1)
            # the holder gone (its generation cancelled): its slot frees
            await asyncio.gather(*batch, interactive)
        return done
    assert asyncio.run(main())[0] == "assistant"
    assert metric(url, "tokenmill_tenant_requests_total", tenant="sweeps", status="success") == 4
    assert metric(url, "tokenmill_tenant_requests_total", tenant="sweeps", status="disconnected") == 1
    assert waiting() == {"assistant": 0, "sweeps": 0}


def test_a_wait_past_the_queue_timeout_is_a_503_with_retry_after() -> None:
    from tokenmill.api.errors import APIError
    from tokenmill.api.tenancy import DEFAULT_TENANT, FleetQueue

    async def main() -> APIError:
        queue = FleetQueue(1, timeout_s=0.05)
        held = await queue.acquire(DEFAULT_TENANT)
        try:
            await queue.acquire(DEFAULT_TENANT)
        except APIError as exc:
            queue.fair.release(held.slot)
            return exc
        raise AssertionError("the second request was let in past the fleet's one slot")
    error = asyncio.run(main())
    assert error.status == 503 and error.headers == {"Retry-After": "1"}
    assert "saturated for the 0.05 s" in error.detail.message and "--queue-timeout-s" in error.detail.message
    assert error.detail.code == "queue_timeout"


FAIR = "".join(f'[tenants.{name}]\nkeys = ["k-{name}"]\nweight = {weight}\n\n'
               for name, weight in (("heavy", 1), ("light", 1), ("three", 3), ("one", 1), ("holder", 1)))


@pytest.fixture(scope="module")
def fair_server(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serving(tiny_dense, tmp_path_factory.mktemp("fair"), FAIR, "--max-in-flight", "1")


@pytest.mark.parametrize(("tenants", "counts", "ratio"), [(("heavy", "light"), (100, 10), 1.0),
                                                          (("three", "one"), (40, 12), 3.0)])
def test_backlogged_tenants_are_served_tokens_by_weight_whatever_they_send(
        fair_server: Server, tenants: tuple[str, str], counts: tuple[int, int], ratio: float) -> None:
    """Real processes: one slot, held (by a third tenant) while both tenants queue their requests
    (equal ones), then freed; up to the last of the smaller tenant's requests, the tokens each got
    are in the ratio of their weights, within 10%, though one sent many times the other's requests."""
    url = fair_server.url
    first, second = tenants

    def waiting() -> dict[str, int]:
        rows = httpx.get(url + "/admin/tenants", timeout=10, trust_env=False).json()["data"]
        return {row["name"]: row["waiting"] for row in rows}

    async def main() -> list[str]:
        done: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False,
                                     limits=httpx.Limits(max_connections=200)) as client:
            async def one(name: str) -> None:
                r = await client.post("/v1/completions", headers={"Authorization": f"Bearer k-{name}"}, json={
                    "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
                assert r.status_code == 200, r.text
                done.append(name)

            async with _holding_the_slot(client, "k-holder"):
                tasks = [asyncio.create_task(one(name)) for name, n in zip(tenants, counts, strict=True)
                         for _ in range(n)]
                for _ in range(600):
                    queued = await asyncio.to_thread(waiting)
                    if (queued[first], queued[second]) == counts:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"the requests never all queued: {waiting()}")
            # the holder gone, the slot goes round by fair share; stop once the smaller tenant is served
            while done.count(second) < counts[1]:
                await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return done
    order = asyncio.run(main())
    last = max(i for i, name in enumerate(order) if name == second)
    served = [order[:last + 1].count(name) for name in tenants]  # equal requests: tokens go as requests do
    assert served[0] / served[1] == pytest.approx(ratio, rel=0.1), order
