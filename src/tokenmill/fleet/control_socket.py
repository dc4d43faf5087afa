"""`/admin/workers` across API servers: `tokenmill serve --api-servers N` shares one port among
N frontends, but only the serve process runs the workers. It answers the others on a unix
socket in the run directory (`serve_control_socket`); they `forward` what they received there
(after their own API-key check), so the answer does not depend on which server the kernel picked.

One exchange per connection: a JSON line `{"method", "body"}`, answered by a JSON line
`{"status", "body"}`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONTROL_SOCKET_ENV = "TOKENMILL_WORKER_CONTROL_SOCKET"  # set by serve for its other API servers
LINE_LIMIT = 1 << 20
FORWARD_TIMEOUT_S = 30.0

Handler = Callable[[str, bytes], Awaitable[tuple[int, dict[str, Any]]]]


async def serve_control_socket(path: Path, handler: Handler) -> asyncio.AbstractServer:
    """Answer forwarded requests with `handler(method, body)` -> (status, JSON body)."""
    async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await reader.readline())
            status, body = await handler(str(request["method"]), str(request["body"]).encode())
            writer.write(json.dumps({"status": status, "body": body}).encode() + b"\n")
            await writer.drain()
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a broken peer: nothing to answer
            log.warning("bad exchange on the worker-control socket: %s", exc)
        finally:
            writer.close()

    path.unlink(missing_ok=True)  # a previous serve's, in a reused --run-dir
    server = await asyncio.start_unix_server(exchange, path=str(path), limit=LINE_LIMIT)
    os.chmod(path, 0o600)  # the registry's owner only, as the run directory
    return server


async def forward(path: str, method: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """The serve process's answer to this request; ConnectionError when it cannot be reached."""
    try:
        async with asyncio.timeout(FORWARD_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(path, limit=LINE_LIMIT)
            try:
                request = {"method": method, "body": body.decode("utf-8", errors="replace")}
                writer.write(json.dumps(request).encode() + b"\n")
                await writer.drain()
                answer = json.loads(await reader.readline())
            finally:
                writer.close()
        return int(answer["status"]), dict(answer["body"])
    except (OSError, TimeoutError, ValueError, KeyError, TypeError) as exc:
        raise ConnectionError(f"the serve process did not answer on {path}: {exc}") from exc
