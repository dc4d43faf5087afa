"""Discovery over a real etcd on loopback: leases end dead workers, a frontend keeps its last view
while etcd is away, and a worker writes its registration back into an etcd that lost it."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import uvloop

from tests.runtime.etcd_server import EtcdServer
from tokenmill.runtime.discovery import WorkerInfo, discovery_from_url
from tokenmill.runtime.etcd_discovery import EtcdDiscovery, parse_etcd_url


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path)
    server.start()
    yield server
    server.stop()


async def until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


def listed(discovery: EtcdDiscovery) -> list[str]:
    return sorted(w.worker_id for w in discovery.workers())


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    uvloop.run(scenario())  # the servers' loop: grpc.aio must work on it


def test_a_registration_is_seen_and_ends_with_unregister_or_its_lease(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        frontend = discovery_from_url(etcd.url)
        worker, doomed = discovery_from_url(etcd.url, ttl_s=1.0), discovery_from_url(etcd.url, ttl_s=1.0)
        for d in (frontend, worker, doomed):
            await d.start()
        worker.register(WorkerInfo("w0", "tcp://10.0.0.2:5000", "decode", "m", metadata={"block_size": 16}))
        doomed.register(WorkerInfo("w1", "tcp://10.0.0.3:5000", "prefill", "m"))
        await until(lambda: listed(frontend) == ["w0", "w1"])
        seen = {w.worker_id: w for w in frontend.workers()}["w0"]
        assert (seen.address, seen.role, seen.metadata) == ("tcp://10.0.0.2:5000", "decode", {"block_size": 16})
        worker.unregister("w0")
        await until(lambda: listed(frontend) == ["w1"], timeout_s=5)
        for task in doomed._tasks:  # the process dies: no keep-alive, no goodbye
            task.cancel()
        await until(lambda: listed(frontend) == [], timeout_s=10)  # its lease expired
        for d in (frontend, worker):
            await d.close()

    run(scenario)


def test_without_etcd_the_view_holds_and_registrations_return_with_it(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        frontend, worker = discovery_from_url(etcd.url), discovery_from_url(etcd.url, ttl_s=1.0)
        for d in (frontend, worker):
            await d.start()
        worker.register(WorkerInfo("w0", "tcp://10.0.0.2:5000"))
        await until(lambda: listed(frontend) == ["w0"])
        await asyncio.to_thread(etcd.stop)
        await asyncio.sleep(2.5)  # past the lease: nothing could have kept it alive
        assert listed(frontend) == ["w0"]  # the last known set, not an empty fleet
        await asyncio.to_thread(etcd.restart, True)  # its data lost too
        await until(lambda: worker.connected and listed(frontend) == ["w0"], timeout_s=20)
        for d in (frontend, worker):
            await d.close()

    run(scenario)


def test_close_removes_the_registration_at_once(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        frontend, worker = discovery_from_url(etcd.url), discovery_from_url(etcd.url, ttl_s=30.0)
        for d in (frontend, worker):
            await d.start()
        worker.register(WorkerInfo("w0", "tcp://10.0.0.2:5000"))
        await until(lambda: listed(frontend) == ["w0"])
        await worker.close()
        await until(lambda: listed(frontend) == [], timeout_s=15)  # at once, not at the 30 s lease, on a busy host too
        await frontend.close()

    run(scenario)


def test_close_returns_even_when_a_background_task_does_not_end(etcd: EtcdServer) -> None:
    """aetcd can swallow the cancel of a watch that was being made when the reader closed (a frontend
    stopping right after it connected): close must still return, within its bound."""
    async def scenario() -> None:
        reader = discovery_from_url(etcd.url)
        await reader.start()
        reader.workers()
        await until(lambda: reader.connected)
        released = asyncio.Event()

        async def stubborn() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await released.wait()  # ignores the cancel, as the stuck watch does

        task = asyncio.create_task(stubborn())
        reader._tasks.append(task)
        await asyncio.sleep(0)
        async with asyncio.timeout(10):
            await reader.close(timeout_s=0.5)
        assert not task.done()  # close returned although the task still runs
        released.set()
        await task

    run(scenario)


@pytest.mark.parametrize("url,message", [("etcd://", "host:port"), ("etcd://h", "host:port"),
                                         ("etcd://h:x", "host:port"), ("etcd://h:1,", None)])
def test_etcd_urls(url: str, message: str | None) -> None:
    if message is None:
        assert parse_etcd_url(url) == ([("h", 1)], "/tokenmill/workers/")
        return
    with pytest.raises(ValueError, match="--discovery"):
        parse_etcd_url(url)
    assert parse_etcd_url("etcd://a:1,b:2/fleet/x") == ([("a", 1), ("b", 2)], "/fleet/x/")
    with pytest.raises(ValueError, match="--discovery-ttl-s"):
        EtcdDiscovery([("a", 1)], ttl_s=0.5)
