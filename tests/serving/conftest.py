"""A real `tokenmill serve` (frontend + worker processes) on a free loopback port."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.bench.harness.serve_process import ServeProcess as Server
from tokenmill.bench.harness.serve_process import start_serve, stop
from tokenmill.runtime.netns import Hosts

__all__ = ["Server", "start_server", "stop_server"]


def start_server(model: Path, run_dir: Path, *flags: str, workers: int = 1, start_timeout_s: float = 90) -> Server:
    """Serve `model` as "tiny"; healthy with every worker registered, or RuntimeError."""
    return start_serve(["--model", str(model), "--served-model-name", "tiny", *flags], workers, run_dir,
                       run_dir / "serve.log", start_timeout_s=start_timeout_s)


def stop_server(server: Server) -> None:
    stop(server)


@pytest.fixture(scope="module")
def two_worker_server(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_dense, tmp_path_factory.mktemp("run"), "--kv-cache-blocks", "512", workers=2)
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Four network namespaces on a bridge, for the multi-host tests (tests/serving/multi_host.py)."""
    made = Hosts(4)
    yield made
    made.close()
