"""A worker whose KV blocks are not the router's size is never routed to (its prompts would be
counted in other blocks than it caches); one of the same size joins. A fleet mixing --deterministic
workers with default ones is served, and said."""
from __future__ import annotations

import asyncio
import logging

import pytest

from tokenmill.fleet.worker_pool import WorkerPool
from tokenmill.router.policies import Router, RouterConfig
from tokenmill.runtime.discovery import MemoryDiscovery, WorkerInfo


def test_a_worker_of_another_block_size_is_refused_once_and_the_rest_join(caplog: pytest.LogCaptureFixture) -> None:
    discovery = MemoryDiscovery()
    for name, size in (("vllm-0", 32), ("own-0", 16)):
        discovery.register(WorkerInfo(name, f"ipc:///tmp/never-{name}.sock", incarnation=name,
                                      metadata={"block_size": size}))

    async def joined() -> set[str]:  # a connection reads its socket on the running loop
        pool = WorkerPool(discovery, Router(RouterConfig(policy="kv", block_size=16)))
        try:
            pool.refresh()
            pool.refresh()
            return set(pool.connections)
        finally:
            await pool.stop()

    with caplog.at_level(logging.ERROR, logger="tokenmill.fleet.worker_pool"):
        assert asyncio.run(joined()) == {"own-0"}
    refusals = [r.getMessage() for r in caplog.records if "vllm-0" in r.getMessage()]
    assert len(refusals) == 1 and "blocks of 32 tokens" in refusals[0] and "--block-size is 16" in refusals[0]


def test_a_fleet_mixing_deterministic_and_default_workers_is_said(caplog: pytest.LogCaptureFixture) -> None:
    discovery = MemoryDiscovery()
    for name, deterministic in (("det-0", True), ("det-1", True), ("plain-0", False)):
        discovery.register(WorkerInfo(name, f"ipc:///tmp/never-{name}.sock", incarnation=name,
                                      metadata={"block_size": 16, "deterministic": deterministic}))

    async def joined() -> set[str]:
        pool = WorkerPool(discovery, Router(RouterConfig(policy="kv", block_size=16)))
        try:
            pool.refresh()
            return set(pool.connections)
        finally:
            await pool.stop()

    with caplog.at_level(logging.WARNING, logger="tokenmill.fleet.worker_pool"):
        assert asyncio.run(joined()) == {"det-0", "det-1", "plain-0"}  # served all the same
    said = [r.getMessage() for r in caplog.records if "--deterministic" in r.getMessage()]
    assert len(said) == 1 and "plain-0 runs without --deterministic" in said[0]
