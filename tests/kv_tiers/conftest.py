"""Fixtures for the tier tests: a real `redis-server` per test (the tests fail without one)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kv_tiers.helpers import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.workdir.mkdir()
    server.start()
    yield server
    server.stop()
