"""Notifications arrive in order; shared memory and sockets are gone after close."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from tests.transfer.helpers import LAYOUT, agent_pair, run
from tokenmill.transfer import SharedBuffer, TransferAgent, allocate_shared_tensor
from tokenmill.transfer.memory import SHM_DIR, SHM_PREFIX
from tokenmill.transfer.peer_process import POOL_REGION, PeerProcess, PeerSpec


def _shm_files() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{SHM_PREFIX}*")}


@pytest.mark.parametrize("backends", [["shm", "tcp"], ["tcp"]])
def test_notifications_from_another_process_arrive_in_order(backends: list[str]) -> None:
    async def main() -> None:
        async with TransferAgent("prefill", backends) as agent:
            with PeerProcess(PeerSpec("decode-proc", 4096, backends=backends)) as peer:
                messages = [f"ack {i}".encode() for i in range(40)]
                sending = asyncio.create_task(peer.call_async("notify", peer=agent.metadata(), messages=messages))
                received = [await agent.next_notification(timeout=30) for _ in messages]
                await sending
                assert [(n.sender, n.message) for n in received] == [("decode-proc", m) for m in messages]
                # and the other way round, to the child's own queue
                agent.add_remote(peer.metadata)
                for message in messages[:5]:
                    await agent.notify("decode-proc", message)
                reply = await peer.call_async("notifications", count=5)
                assert reply["messages"] == [["prefill", m] for m in messages[:5]]

    run(main())


def test_concurrent_notifications_keep_call_order() -> None:
    async def main() -> None:
        async with agent_pair() as pair:
            await asyncio.gather(*(pair.decode.notify("prefill", bytes([i])) for i in range(30)))
            got = [(await pair.prefill.next_notification(timeout=10)).message for _ in range(30)]
            assert got == [bytes([i]) for i in range(30)]

    run(main())


def test_shared_tensor_is_unlinked_on_close_even_with_views_alive() -> None:
    pool = allocate_shared_tensor((4, 8), torch.float32)
    path = SHM_DIR / pool.shared.shm_name
    peer_view = SharedBuffer.attach(pool.shared.shm_name, pool.shared.length)
    pool.tensor.fill_(1.5)
    assert bytes(peer_view.view[:4]) == torch.tensor([1.5]).numpy().tobytes()  # the same pages
    peer_view.close()
    assert path.exists()  # attachers never unlink
    pool.close()
    assert not path.exists()
    assert float(pool.tensor.sum()) == 48.0  # the tensor stays usable until it is dropped


def _shm_files_of(*pids: int) -> set[str]:
    """The files made by these processes (their names carry the maker's pid): other tests, running
    beside this one, make and remove their own."""
    return {name for name in _shm_files() if name.removeprefix(SHM_PREFIX).split("-")[0] in map(str, pids)}


def test_agents_and_peer_processes_leave_nothing_in_shared_memory() -> None:
    me, peers = os.getpid(), []
    before = _shm_files_of(me)

    async def main() -> None:
        async with agent_pair():
            assert len(_shm_files_of(me) - before) == 4  # two pools, two notification sockets
        with PeerProcess(PeerSpec("short-lived", LAYOUT.total_bytes)) as peer:
            pool = peer.metadata["regions"][POOL_REGION]["shm_name"]
            assert Path(SHM_DIR / pool).exists()
            peers.append(int(pool.removeprefix(SHM_PREFIX).split("-")[0]))

    run(main())
    assert peers and _shm_files_of(me, *peers) == before


def test_shared_memory_names_are_checked() -> None:
    with pytest.raises(ValueError, match="must match"):
        SharedBuffer.attach("../etc/passwd", 10)
    with pytest.raises(ValueError, match="positive"):
        SharedBuffer.create(0)
