"""The release half of a KV handoff, for whichever engine holds the blocks: the decode side (or
a frontend's abort) tells the holder's agent `{"release": ID}`, and the holder frees what it held
for ID. Also the peer book both sides keep, so a peer is added once per metadata it publishes.

    peers = PeerBook(agent)
    await send_release(peers, handle["agent"], request_id)     # retried; logs, never raises
    async for note in agent.notifications():
        request_id = released_request(note)                    # None (logged) for a bad message
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgpack

from tokenmill.transfer.agent import TransferAgent
from tokenmill.transfer.handle import Notification, TransferError, TransferHandle

log = logging.getLogger(__name__)


class PeerBook:
    """The peers an agent has added, by name: re-added only when a peer publishes new metadata
    (a restart), dropped after a failure so the next use reconnects."""

    def __init__(self, agent: TransferAgent) -> None:
        self.agent = agent
        self._metadata: dict[str, dict[str, Any]] = {}

    def remote(self, metadata: dict[str, Any]) -> str:
        name = str(metadata["name"])
        if self._metadata.get(name) != metadata:
            self.agent.add_remote(metadata)
            self._metadata[name] = metadata
        return name

    def forget(self, name: str) -> None:
        self._metadata.pop(name, None)
        self.agent.remove_remote(name)

    async def drop_connection(self, transfer: TransferHandle, name: str) -> None:
        """Fault injection: cut the connection at the first await the transfer makes once it has one."""
        while not transfer.done():
            self.forget(name)
            await asyncio.sleep(0)


def release_message(request_id: str) -> bytes:
    return msgpack.packb({"release": request_id})


def released_request(note: Notification) -> str | None:
    try:
        return str(msgpack.unpackb(note.message)["release"])
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        log.warning("bad notification from %s: %s", note.sender, exc)
        return None


async def send_release(peers: PeerBook, holder: dict[str, Any], request_id: str, attempts: int = 3) -> bool:
    """Tell the holder (its agent metadata) to free `request_id`'s blocks; retried, as a dropped
    connection is likely right after a failed pull (the holder's timeout frees them if all fail)."""
    for attempt in range(attempts):
        try:
            await peers.agent.notify(peers.remote(holder), release_message(request_id))
            return True
        except (OSError, ValueError, KeyError, TypeError, TransferError) as exc:
            if attempt == attempts - 1:
                log.info("could not tell the prefill worker to release %s: %s", request_id, exc)
            else:
                await asyncio.sleep(0.05 * (attempt + 1))
    return False
