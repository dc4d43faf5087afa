"""A `TransferAgent` in a child process, for cross-process tests and `tokenmill bench transfer`.

The child allocates one shared-memory region named "pool" of `pool_bytes` random bytes (seeded),
registers it, sends its metadata, then answers commands from the parent over a pipe, one at a
time, as msgpack maps (never pickle):

    checksum {descs}                 -> {checksum}       xxh3-64 of its bytes at descs
    poke {offset, data}              -> {}                overwrite bytes of its pool
    read {peer, remote, local}       -> {status, reason}  pull from the parent (peer = metadata)
    notify {peer, messages}          -> {}                send notifications, in order
    notifications {count, timeout}   -> {messages: [[sender, message], ...]}
    stop                             -> {}                close the agent and unlink the pool

Measuring a transfer against a peer in another process is what makes shm honest: the bytes come
out of another process's mapping, not this process's own pages.

`PeerSpec.netns` puts the child on another "host": it enters that network namespace (setns(2),
`tokenmill.runtime.netns.enter_netns`) before its event loop starts, so its tcp server and every
thread it starts live there; `tcp_host` is the address its tcp backend binds and advertises
(one of that namespace's). The parent keeps the same spawn + pipe handle either way: `ip netns
exec` would need its own launcher for multiprocessing and also unshares a mount namespace, which
setns leaves alone (/dev/shm stays one and the same).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np

from tokenmill.transfer.agent import TransferAgent
from tokenmill.transfer.backends import Backend, TcpBackend
from tokenmill.transfer.descriptors import decode_descriptors
from tokenmill.transfer.memory import MemoryRegion, SharedBuffer

log = logging.getLogger(__name__)

POOL_REGION = "pool"


@dataclass(slots=True)
class PeerSpec:
    name: str
    pool_bytes: int
    backends: list[str] = field(default_factory=lambda: ["shm", "tcp"])
    seed: int = 0
    netns: str | None = None  # network namespace (under /var/run/netns) the child runs in
    tcp_host: str | None = None  # the tcp backend's bind and advertised address; None: its default


class PeerProcess:
    """Parent-side handle on the child agent: `start()` returns its metadata, `call()` a command."""

    def __init__(self, spec: PeerSpec) -> None:
        self.spec = spec
        context = multiprocessing.get_context("spawn")  # no fork: the parent may hold threads and a loop
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_child_main, args=(child_conn, msgpack.packb(asdict(spec))),
                                        name=f"transfer-peer-{spec.name}", daemon=True)
        self.metadata: dict[str, Any] = {}

    def start(self, timeout: float = 60.0) -> dict[str, Any]:
        self._process.start()
        self.metadata = self._receive(timeout)["metadata"]
        return self.metadata

    def call(self, op: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        self._conn.send_bytes(msgpack.packb({"op": op, **args}, use_bin_type=True))
        return self._receive(timeout)

    async def call_async(self, op: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        return await asyncio.to_thread(self.call, op, timeout, **args)

    def _receive(self, timeout: float) -> dict[str, Any]:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer process {self.spec.name!r} did not answer within {timeout} s")
        reply = msgpack.unpackb(self._conn.recv_bytes(), raw=False)
        if "error" in reply:
            raise RuntimeError(f"peer process {self.spec.name!r}: {reply['error']}")
        return reply

    def kill(self) -> None:
        """SIGKILL: no cleanup runs in the child (its shared memory file is left behind)."""
        self._process.kill()
        self._process.join(10)

    def stop(self) -> None:
        if self._process.is_alive():
            try:
                self.call("stop", timeout=30)
            except (OSError, EOFError, TimeoutError) as exc:
                log.warning("peer %r did not stop cleanly: %s", self.spec.name, exc)
        self._process.join(30)
        self._conn.close()

    def __enter__(self) -> PeerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _child_main(conn: Connection, spec_bytes: bytes) -> None:
    spec = PeerSpec(**msgpack.unpackb(spec_bytes, raw=False))
    if spec.netns is not None:
        from tokenmill.runtime.netns import enter_netns

        try:
            enter_netns(spec.netns)  # before the loop: its executor threads inherit the namespace
        except OSError as exc:
            conn.send_bytes(msgpack.packb({"error": str(exc)}))
            return
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(conn, spec))


def _backends(spec: PeerSpec) -> list[str | Backend]:
    if spec.tcp_host is None:
        return list(spec.backends)
    return [TcpBackend(host=spec.tcp_host) if name == "tcp" else name for name in spec.backends]


async def _serve(conn: Connection, spec: PeerSpec) -> None:
    shared = SharedBuffer.create(spec.pool_bytes)
    try:
        np.frombuffer(shared.view, dtype=np.uint8)[:] = np.frombuffer(
            np.random.default_rng(spec.seed).bytes(spec.pool_bytes), dtype=np.uint8)
        async with TransferAgent(spec.name, _backends(spec)) as agent:
            agent.register(MemoryRegion(POOL_REGION, "shm", shared.view, shm_name=shared.shm_name))
            conn.send_bytes(msgpack.packb({"metadata": agent.metadata()}, use_bin_type=True))
            await _command_loop(conn, agent, shared)
    finally:
        shared.close()


async def _command_loop(conn: Connection, agent: TransferAgent, shared: SharedBuffer) -> None:
    while True:
        request = msgpack.unpackb(await asyncio.to_thread(conn.recv_bytes), raw=False)
        op = request.pop("op")
        if op == "stop":
            conn.send_bytes(msgpack.packb({}))
            return
        command = _COMMANDS.get(op)
        try:
            if command is None:
                raise ValueError(f"unknown command {op!r}")
            reply = await command(agent, shared, request)
        except Exception as exc:  # report to the parent instead of dying silently
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send_bytes(msgpack.packb(reply, use_bin_type=True))


async def _checksum(agent: TransferAgent, shared: SharedBuffer, request: dict[str, Any]) -> dict[str, Any]:
    return {"checksum": agent.checksum(decode_descriptors(request["descs"]))}


async def _poke(agent: TransferAgent, shared: SharedBuffer, request: dict[str, Any]) -> dict[str, Any]:
    data = request["data"]
    shared.view[request["offset"]:request["offset"] + len(data)] = data
    return {}


async def _read(agent: TransferAgent, shared: SharedBuffer, request: dict[str, Any]) -> dict[str, Any]:
    peer = agent.add_remote(request["peer"])
    handle = agent.read(peer, decode_descriptors(request["remote"]), decode_descriptors(request["local"]),
                        backend=request.get("backend"))
    status = await handle.wait()
    return {"status": status.value, "reason": handle.reason, "backend": handle.backend}


async def _notify(agent: TransferAgent, shared: SharedBuffer, request: dict[str, Any]) -> dict[str, Any]:
    peer = agent.add_remote(request["peer"])
    for message in request["messages"]:
        await agent.notify(peer, message)
    return {}


async def _notifications(agent: TransferAgent, shared: SharedBuffer, request: dict[str, Any]) -> dict[str, Any]:
    received = [await agent.next_notification(request.get("timeout", 10.0)) for _ in range(request["count"])]
    return {"messages": [[n.sender, n.message] for n in received]}


_COMMANDS: dict[str, Callable[[TransferAgent, SharedBuffer, dict[str, Any]], Awaitable[dict[str, Any]]]] = {
    "checksum": _checksum, "poke": _poke, "read": _read, "notify": _notify, "notifications": _notifications,
}
