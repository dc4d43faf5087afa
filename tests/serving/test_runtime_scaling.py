"""Runtime scaling through `/admin/workers` on a real `tokenmill serve` with mock workers:
start, drain (never aborting a stream), refusals naming the field, failed starts, and the
in-process planner acting through it (retries, the fast path, a pause). Re-roling and several
API servers: `test_worker_control.py`."""
from __future__ import annotations

import asyncio
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from tests.serving.conftest import Server, start_server, stop_server

STEP_S = "0.04"  # each mock decode step: a 100-token stream lasts about 4 s
STREAM_TOKENS = 100
ADMIN_KEY = "admin-5678"


@pytest.fixture(scope="module")
def agg(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """One launch worker; a model copy of its own, which the failed-start test moves away."""
    root = tmp_path_factory.mktemp("scaling")
    model = Path(shutil.copytree(tiny_dense, root / "model"))
    server = start_server(model, root / "run", "--runner", "mock", "--mock-step-time", f"{STEP_S},0,0,0",
                          "--max-num-seqs", "16", workers=1)
    try:
        yield server, model
    finally:
        stop_server(server)


def admin(server: Server, body: Any = None, raw: bytes | None = None, key: str | None = None) -> httpx.Response:
    """GET /admin/workers, or POST it `body` (JSON) or `raw` bytes; a fresh connection each time."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False, headers=headers) as client:
        if body is None and raw is None:
            return client.get("/admin/workers")
        if raw is not None:
            return client.post("/admin/workers", content=raw)
        return client.post("/admin/workers", json=body)


def workers(server: Server) -> dict[str, dict[str, Any]]:
    response = admin(server)
    assert response.status_code == 200, response.text
    return {w["name"]: w for w in response.json()["data"]}


def wait_for(server: Server, check: Callable[[dict[str, dict[str, Any]]], bool], timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = workers(server)
        if check(listed):
            return listed
        time.sleep(0.1)
    raise AssertionError(f"not reached within {timeout_s} s: {listed}")


def state_is(name: str, state: str) -> Callable[[dict[str, dict[str, Any]]], bool]:
    return lambda listed: name in listed and listed[name]["state"] == state


async def stream(client: openai.AsyncOpenAI, i: int, max_tokens: int) -> tuple[str, int]:
    """(finish_reason, completion tokens) of one streamed completion; an error event raises."""
    chunks = await client.completions.create(model="tiny", prompt=[5 + i, 6, 7, 8], max_tokens=max_tokens,
                                             temperature=0, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    reason, usage = None, None
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
        usage = chunk.usage or usage
    return reason, usage.completion_tokens


async def completions(server: Server, count: int, max_tokens: int = 4) -> list[tuple[str, int]]:
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        return await asyncio.gather(*(stream(client, i, max_tokens) for i in range(count)))


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_drain_while_streaming_finishes_every_stream(agg: tuple[Server, Path]) -> None:
    server, _ = agg

    async def scenario() -> list[tuple[str, int]]:
        streams = asyncio.ensure_future(completions(server, 8, STREAM_TOKENS))
        await asyncio.to_thread(wait_for, server, lambda w: w["worker-0"]["in_flight"] == 8, 10)
        started = await asyncio.to_thread(admin, server, {"action": "start", "role": "agg"})
        assert started.status_code == 202, started.text
        assert [(w["name"], w["state"]) for w in started.json()["started"]] == [("worker-1", "starting")]
        await asyncio.to_thread(wait_for, server, state_is("worker-1", "serving"))
        drained = await asyncio.to_thread(admin, server, {"action": "drain", "worker": "worker-0"})
        assert drained.status_code == 202, drained.text
        [record] = drained.json()["drained"]
        assert (record["name"], record["state"], record["in_flight"]) == ("worker-0", "draining", 8)
        assert not streams.done()  # drained mid-stream
        return await streams

    results = asyncio.run(scenario())
    assert results == [("length", STREAM_TOKENS)] * 8
    listed = wait_for(server, state_is("worker-0", "gone"), 15)
    assert listed["worker-0"]["exit_code"] == 0 and not alive(listed["worker-0"]["pid"])
    assert listed["worker-1"]["state"] == "serving"
    metrics = httpx.get(server.url + "/metrics", trust_env=False).text
    assert re.search(r"^tokenmill_workers 1\.0$", metrics, re.MULTILINE) and 'worker="worker-0"' not in metrics
    # finished where they were, not migrated (a migration would hide an abort from the client)
    assert re.search(r"^tokenmill_request_migrations_total 0\.0$", metrics, re.MULTILINE)
    before = listed["worker-1"]["requests_served"]
    assert asyncio.run(completions(server, 3)) == [("length", 4)] * 3
    wait_for(server, lambda w: w["worker-1"]["requests_served"] == before + 3, 5)
    time.sleep(1.0)  # a drained worker stays gone: the supervisor does not restart it
    assert workers(server)["worker-0"]["state"] == "gone"


def test_a_started_worker_goes_from_starting_to_serving_and_takes_requests(agg: tuple[Server, Path]) -> None:
    server, _ = agg
    response = admin(server, {"action": "start", "role": "agg", "count": 1})
    assert response.status_code == 202, response.text
    [record] = response.json()["started"]
    assert record["name"] == "worker-2" and record["origin"] == "admin" and record["pid"] > 0
    assert workers(server)["worker-2"]["state"] == "starting"
    listed = wait_for(server, state_is("worker-2", "serving"))
    assert admin(server).json()["replicas"] == {"agg": {"starting": 0, "serving": 2, "draining": 0}}
    assert listed["worker-2"]["requests_served"] == 0
    assert asyncio.run(completions(server, 6, 20)) == [("length", 20)] * 6  # least-loaded: both get some
    wait_for(server, lambda w: w["worker-2"]["requests_served"] > 0, 5)


@pytest.mark.parametrize("body,status,param", [
    ({"action": "scale"}, 400, "action"),
    ({"role": "agg"}, 400, "action"),
    ({"action": "start", "role": "gpu"}, 400, "role"),
    ({"action": "start", "role": "decode"}, 400, "role"),  # an aggregated serve
    ({"action": "start", "role": "agg", "count": 0}, 400, "count"),
    ({"action": "start", "role": "agg", "count": 65}, 400, "count"),
    ({"action": "start", "role": "agg", "count": "2"}, 400, "count"),
    ({"action": "start", "role": "agg", "count": True}, 400, "count"),
    ({"action": "start", "role": "agg", "cuont": 2}, 400, "cuont"),
    ({"action": "drain"}, 400, "role"),
    ({"action": "drain", "worker": ""}, 400, "worker"),
    ({"action": "drain", "worker": "worker-1", "count": 1}, 400, "worker"),
    ({"action": "drain", "worker": "worker-9"}, 404, "worker"),
    ({"action": "drain", "worker": "worker-0"}, 409, "worker"),  # gone already
    ({"action": "drain", "role": "agg", "count": 2}, 409, "role"),  # would leave none serving
    ({"action": "drain", "role": "agg", "count": 3}, 409, "count"),  # only 2 serve
    ({"action": "rerole", "worker": "worker-1", "to": "prefill"}, 400, "to"),
    ({"action": "rerole", "worker": "worker-1", "to": "agg"}, 400, "to"),
    ({"action": "rerole", "worker": "worker-1"}, 400, "to"),
    ([], 400, None),
])
def test_bad_requests_are_refused_naming_the_field(agg: tuple[Server, Path], body: Any, status: int,
                                                   param: str | None) -> None:
    response = admin(agg[0], body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert admin(agg[0]).json()["replicas"]["agg"]["serving"] == 2  # nothing changed


def test_draining_the_last_serving_worker_is_a_409(agg: tuple[Server, Path]) -> None:
    server, _ = agg
    assert admin(server, raw=b"{not json").status_code == 400
    drained = admin(server, {"action": "drain", "role": "agg", "count": 1})  # the newest
    assert drained.status_code == 202 and drained.json()["drained"][0]["name"] == "worker-2"
    last = admin(server, {"action": "drain", "worker": "worker-1"})
    assert last.status_code == 409 and last.json()["error"]["code"] == "last_serving_worker", last.text
    wait_for(server, state_is("worker-2", "gone"), 15)
    assert httpx.get(server.url + "/health", trust_env=False).status_code == 200


def test_a_start_that_fails_is_reported_and_not_counted(agg: tuple[Server, Path]) -> None:
    server, model = agg
    moved = model.rename(model.with_name("moved"))  # what a new worker loads is gone; the running ones hold it
    try:
        response = admin(server, {"action": "start", "role": "agg"})
        assert response.status_code == 202
        name = response.json()["started"][0]["name"]
        listed = wait_for(server, state_is(name, "failed"), 20)
    finally:
        moved.rename(model)
    record = listed[name]
    assert "before it registered" in record["reason"] and "config.json" in record["reason"], record
    assert record["exit_code"] == 2 and record["restarts"] == 0
    assert admin(server).json()["replicas"]["agg"] == {"starting": 0, "serving": 1, "draining": 0}
    time.sleep(0.5)
    assert workers(server)[name]["state"] == "failed"  # not restarted behind our back
    assert asyncio.run(completions(server, 2)) == [("length", 4)] * 2


class _FixedLoad:
    """A forecaster that always predicts the same load (the planner under test is the rest)."""

    def observe(self, requests: float, isl: float | None, osl: float | None) -> None:
        pass

    def predict(self) -> Any:
        from tokenmill.planner.predict import LoadForecast

        return LoadForecast(10.0, 1000.0, 100.0, "fixed")  # 10 req/s at interval 1 s: two agg replicas


def test_the_planner_retries_a_start_that_failed_and_never_counts_it(agg: tuple[Server, Path]) -> None:
    """The local connector against a real serve: a failed start is reported as such (its POST
    accepted, the worker `failed`), the next decision does not count it and asks again, and once a
    start succeeds the planner holds."""
    from tests.planner.test_propose import FixedModel
    from tokenmill.planner.constrain import Constrainer, Limits
    from tokenmill.planner.live import LiveDeployment
    from tokenmill.planner.planner import Planner
    from tokenmill.planner.propose import Proposer

    server, model = agg
    planner = Planner(_FixedLoad(), Proposer({"agg": FixedModel()}, disaggregated=False),
                      Constrainer(Limits(), {"agg": 1}, 700.0))

    async def scenario() -> list[Any]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, trust_env=False) as client:
            live = LiveDeployment(planner, client, interval_s=1.0, warmup_s=0.0)
            moved = model.rename(model.with_name("moved"))
            try:
                first = await live.tick()
                failed = live.outcomes[-1].detail["started"][0]["name"]
                await asyncio.to_thread(wait_for, server, state_is(failed, "failed"), 20)
            finally:
                moved.rename(model)
            retry = await live.tick()
            started = live.outcomes[-1].detail["started"][0]["name"]
            await asyncio.to_thread(wait_for, server, state_is(started, "serving"), 30)
            settled = await live.tick()
            return [first, retry, settled, failed, started, list(live.outcomes)]

    first, retry, settled, failed, started, outcomes = asyncio.run(scenario())
    try:
        assert first.current == {"agg": 1} and [(a.role, a.delta) for a in first.actions] == [("agg", 1)]
        assert retry.current == {"agg": 1}, retry.reason  # the failed worker is not counted as present
        assert [(a.role, a.delta) for a in retry.actions] == [("agg", 1)] and started != failed
        assert settled.current == {"agg": 2} and settled.actions == [], settled.reason
        assert [o.status for o in outcomes] == [202, 202]
        assert workers(server)[failed]["state"] == "failed"
    finally:
        admin(server, {"action": "drain", "worker": started})
        wait_for(server, lambda listed: started not in listed or listed[started]["state"] != "draining", 30)


def test_the_live_fast_path_starts_a_worker_as_soon_as_first_tokens_are_late(agg: tuple[Server, Path]) -> None:
    """Between intervals (here far longer than the test) the local connector scrapes every 0.3 s;
    a burst queued past the TTFT target on the one worker (16 streams at a time, each 1.6 s long)
    makes the fast path start a worker at once, over that short window, and say why."""
    from tests.planner.test_propose import FixedModel
    from tokenmill.planner.constrain import Constrainer, Limits
    from tokenmill.planner.live import LiveDeployment
    from tokenmill.planner.metrics import PlannerMetrics
    from tokenmill.planner.planner import Planner
    from tokenmill.planner.propose import Proposer

    server, _ = agg
    planner = Planner(_FixedLoad(), Proposer({"agg": FixedModel()}, disaggregated=False),
                      Constrainer(Limits(), {"agg": 1}, 700.0))
    registry = CollectorRegistry()

    async def scenario() -> tuple[list[tuple[str, int]], LiveDeployment]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, trust_env=False) as client, \
                openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as api:
            live = LiveDeployment(planner, client, interval_s=600.0, warmup_s=0.0, fast_s=0.3,
                                  metrics=PlannerMetrics(registry, {"agg": 1}))
            stop = asyncio.Event()
            task = asyncio.create_task(live.run(stop))
            await asyncio.sleep(0.1)  # the baseline scrape
            results = await asyncio.gather(*(stream(api, i, 40) for i in range(40)))
            deadline = time.monotonic() + 10
            while not planner.decisions and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            stop.set()
            await task
            return results, live

    results, live = asyncio.run(scenario())
    started = [w["name"] for o in live.outcomes for w in (o.detail or {}).get("started", [])]
    try:
        assert results == [("length", 40)] * 40
        assert planner.decisions, "no fast decision while first tokens waited past the target"
        first = planner.decisions[0]
        assert first.path == "fast" and first.reason.startswith("fast path: agg: TTFT p90"), first.reason
        assert first.observed.interval_s == pytest.approx(0.3)
        assert [(a.role, a.delta > 0) for a in first.actions] == [("agg", True)]
        assert live.outcomes[0].status == 202 and started
        fast = registry.get_sample_value("tokenmill_planner_decisions_total", {"kind": "fast_scale_up"})
        assert fast == len(planner.decisions)
        # GPU-hours are the intervals' to count, and no interval has ended
        assert registry.get_sample_value("tokenmill_planner_gpu_hours_total") == 0.0
    finally:
        for name in started:
            admin(server, {"action": "drain", "worker": name})
        wait_for(server, lambda listed: all(n not in listed or listed[n]["state"] not in ("starting", "serving",
                                                                                       "draining")
                                            for n in started), 30)


def test_a_paused_planner_observes_but_neither_decides_nor_acts(agg: tuple[Server, Path]) -> None:
    """The dashboard's planner switch: paused, the local connector keeps its baseline current
    (so resuming plans on a fresh interval) and makes no decision and no change."""
    from tests.planner.test_propose import FixedModel
    from tokenmill.planner.constrain import Constrainer, Limits
    from tokenmill.planner.live import LiveDeployment
    from tokenmill.planner.planner import Planner
    from tokenmill.planner.propose import Proposer

    server, _ = agg
    planner = Planner(_FixedLoad(), Proposer({"agg": FixedModel()}, disaggregated=False),
                      Constrainer(Limits(), {"agg": 1}, 700.0))

    async def scenario() -> tuple[LiveDeployment, int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, trust_env=False) as client:
            live = LiveDeployment(planner, client, interval_s=0.3, warmup_s=0.0, paused=True)
            stop = asyncio.Event()
            task = asyncio.create_task(live.run(stop))
            await asyncio.sleep(0.1)
            baseline = id(live._last)
            await asyncio.sleep(1.2)  # about four intervals
            stop.set()
            await task
            return live, baseline

    def live_workers() -> list[str]:
        return sorted(name for name, w in workers(server).items() if w["state"] in ("starting", "serving"))

    before = live_workers()
    live, baseline = asyncio.run(scenario())
    assert not planner.decisions and not live.outcomes  # it wants 2 replicas, yet nothing happened
    assert id(live._last) != baseline  # scraped each interval all the same
    assert live_workers() == before
