"""`GET /health` for an orchestrator's readiness probe (`tokenmill worker --health-port`).

200 while the worker takes new requests (registered, its engine stepping, not draining), 503
otherwise. The standard library's threaded HTTP server, on its own thread: a probe is answered
even while the event loop is busy, and the worker's own signal handling is left alone.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)


class HealthServer:
    def __init__(self, host: str, port: int, ready: Callable[[], bool]) -> None:
        self._ready = ready
        handler = self._handler()
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="health", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("health endpoint on port %d", self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        ready = self._ready

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the standard library's name
                if self.path != "/health":
                    self._reply(404, b'{"error": "not found"}')
                elif ready():
                    self._reply(200, b'{"status": "ok"}')
                else:
                    self._reply(503, b'{"status": "not ready"}')

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: quiet
                return

        return Handler
