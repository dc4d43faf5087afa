"""Live servers for the frontend tests: uvicorn on 127.0.0.1 (a real socket) on its own thread.

Each `LiveServer` owns an event loop on a background thread; the engine's asyncio
side lives on that loop, so tests reach it with `server.call(coro)`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from tokenmill.api.app import create_app
from tokenmill.embedded_backend import LocalBackend
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine

MODEL_NAME = "tiny"
_START_TIMEOUT_S = 60.0


def engine_config(model: Path, **overrides: Any) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", num_kv_blocks=256, **overrides)


@dataclass
class LiveServer:
    backend: LocalBackend
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    servers: list[uvicorn.Server] = field(default_factory=list)
    serving: list[concurrent.futures.Future[None]] = field(default_factory=list)
    thread: threading.Thread | None = None

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.backend.engine

    def start(self, app: FastAPI) -> str:
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.thread.start()
        return self.serve(app, lifespan="on")

    def serve(self, app: FastAPI, lifespan: str = "off") -> str:
        """Serve `app` on a fresh port from this server's loop (apps may share its backend)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, lifespan=lifespan, log_level="warning", timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
        self.servers.append(server)
        self.serving.append(asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop))
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.should_exit = True
        concurrent.futures.wait(self.serving, timeout=10.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not None:
            self.thread.join(timeout=10.0)


@dataclass
class Served:
    url: str
    live: LiveServer


def _launch(model: Path, max_queue: int | None = None, **app_options: Any) -> tuple[LiveServer, str]:
    config_overrides = {"max_num_seqs": 2} if max_queue is not None else {}
    engine = AsyncLLMEngine(LLMEngine(engine_config(model, **config_overrides)))
    live = LiveServer(LocalBackend(engine, MODEL_NAME, max_queue=max_queue))
    url = live.start(create_app(live.backend, MODEL_NAME, **app_options))
    return live, url


@pytest.fixture(scope="session")
def server(tiny_dense: Path) -> Iterator[Served]:
    logging.getLogger("tokenmill").setLevel(logging.WARNING)
    live, url = _launch(tiny_dense, usd_per_worker_hour=3.0)
    yield Served(url, live)
    live.stop()


@pytest.fixture(scope="session")
def overload_server(tiny_dense: Path) -> Iterator[Served]:
    """max_num_seqs=2 and a queue limit of 4: at most 6 requests in flight."""
    live, url = _launch(tiny_dense, max_queue=4)
    yield Served(url, live)
    live.stop()


@pytest.fixture(scope="session")
def reference_engine(tiny_dense: Path) -> LLMEngine:
    """A second engine on the same checkpoint, driven in-process, for parity checks."""
    return LLMEngine(engine_config(tiny_dense))
