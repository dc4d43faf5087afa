"""The `Backend` protocol: how bytes move between two agents.

The agent validates and coalesces descriptor lists, picks a backend, and runs the backend's
coroutine inside a `TransferHandle` (timeouts, checksums and status live in the agent, so every
backend gets them). A backend only has to:

- `start(agent_name, local, sink)`: open whatever it listens on and return its connection
  info (msgpack-able; published in the agent's metadata under the backend's `name`);
- `can_reach(peer, remote_kinds, local_kinds)`: whether it can move bytes between these
  regions of this agent and `peer` (e.g. shm: same shared-memory domain, remote regions in shm);
- `read`/`write`: move the bytes of validated, paired, coalesced descriptor lists, raising on
  any failure (the agent turns the exception into a FAILED handle);
- `notify`: deliver a message to the peer's notification queue, in call order;
- `forget(peer_name)` and `close()`: drop per-peer state (mappings, connections) and everything.

A CUDA IPC, NCCL or UCX backend implements the same five calls (its regions have kind "cuda");
callers of `TransferAgent` do not change.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tokenmill.transfer.backends.server import NotificationSink
from tokenmill.transfer.descriptors import Descriptor
from tokenmill.transfer.regions import PeerInfo, RegionTable


class Backend(Protocol):
    name: str

    async def start(self, agent_name: str, local: RegionTable, sink: NotificationSink) -> dict[str, Any]: ...

    def can_reach(self, peer: PeerInfo, remote_kinds: set[str], local_kinds: set[str]) -> bool: ...

    async def read(self, peer: PeerInfo, remote: Sequence[Descriptor], local: Sequence[Descriptor]) -> None: ...

    async def write(self, peer: PeerInfo, local: Sequence[Descriptor], remote: Sequence[Descriptor]) -> None: ...

    async def notify(self, peer: PeerInfo, message: bytes) -> None: ...

    def forget(self, peer_name: str) -> None: ...

    async def close(self) -> None: ...
