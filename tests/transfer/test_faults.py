"""Failures end the handle FAILED with a reason, never DONE over bad or partial bytes."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.transfer.helpers import LAYOUT, FaultyProxy, agent_pair, run
from tokenmill.transfer import (
    KVLayout,
    TransferAgent,
    TransferStatus,
    allocate_shared_tensor,
    kv_block_descriptors,
    kv_pair_descriptors,
)
from tokenmill.transfer.descriptors import encode_descriptors
from tokenmill.transfer.memory import SHM_DIR
from tokenmill.transfer.peer_process import POOL_REGION, PeerProcess, PeerSpec

ALL_BLOCKS = list(range(LAYOUT.num_blocks))


def _tcp_address(metadata: dict) -> tuple[str, int]:
    info = metadata["backends"]["tcp"]
    return info["host"], info["port"]


@pytest.mark.parametrize("verify", [True, False])
def test_a_byte_flipped_in_flight_is_caught_by_the_checksum(verify: bool) -> None:
    """The same corrupted stream is DONE without a checksum and FAILED with one."""
    async def main() -> None:
        async with agent_pair(seed=2, backends=("tcp",)) as pair:
            proxy = FaultyProxy(_tcp_address(pair.prefill.metadata()), flip_at=5000)
            pair.decode.add_remote(proxy.redirect(pair.prefill.metadata(), await proxy.start()))
            src, dst = kv_pair_descriptors(LAYOUT, "kv", ALL_BLOCKS[:20], LAYOUT, "kv", ALL_BLOCKS[20:40])
            expected = pair.prefill.checksum(src)
            handle = pair.decode.read("prefill", src, dst, expected_checksum=expected if verify else None)
            status = await handle.wait()
            await proxy.close()
            if verify:
                assert status is TransferStatus.FAILED and handle.reason.startswith("checksum mismatch")
            else:
                assert status is TransferStatus.DONE and pair.decode.checksum(dst) != expected

    run(main())


def test_source_changed_after_its_checksum_fails_the_shm_read() -> None:
    """The prefill side reused a block between handing it off and the pull (another process)."""
    async def main() -> None:
        local = allocate_shared_tensor(LAYOUT.shape, torch.bfloat16)
        try:
            with PeerProcess(PeerSpec("prefill-proc", LAYOUT.total_bytes, seed=5)) as peer:
                async with TransferAgent("decode", ["shm"]) as agent:
                    agent.register(local.region("kv"))
                    agent.add_remote(peer.metadata)
                    src, dst = kv_pair_descriptors(LAYOUT, POOL_REGION, [4, 5, 6], LAYOUT, "kv", [0, 1, 2])
                    reply = await peer.call_async("checksum", descs=encode_descriptors(src))
                    await peer.call_async("poke", offset=src[-1].offset + 3, data=b"\x5a\xa5")
                    handle = agent.read("prefill-proc", src, dst, expected_checksum=reply["checksum"])
                    assert await handle.wait() is TransferStatus.FAILED
                    assert handle.reason.startswith("checksum mismatch")
        finally:
            local.close()

    run(main())


def test_connection_dropped_mid_transfer_fails_the_handle_then_tcp_recovers() -> None:
    async def main() -> None:
        async with agent_pair(seed=3, backends=("tcp",)) as pair:
            metadata = pair.prefill.metadata()
            proxy = FaultyProxy(_tcp_address(metadata), drop_after=LAYOUT.total_bytes // 3)
            pair.decode.add_remote(proxy.redirect(metadata, await proxy.start()))
            src, dst = kv_pair_descriptors(LAYOUT, "kv", ALL_BLOCKS, LAYOUT, "kv", ALL_BLOCKS)
            handle = pair.decode.read("prefill", src, dst)
            assert await handle.wait() is TransferStatus.FAILED
            assert "peer closed the connection after" in handle.reason
            assert f"of {LAYOUT.total_bytes} payload bytes" in handle.reason
            await proxy.close()
            pair.decode.add_remote(metadata)  # straight to the server again: it kept serving
            handle = pair.decode.read("prefill", src, dst, expected_checksum=pair.prefill.checksum(src))
            assert await handle.wait() is TransferStatus.DONE, handle.reason

    run(main())


def test_peer_killed_mid_transfer_fails_the_handle() -> None:
    big = KVLayout(num_layers=2, num_blocks=256, block_size=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")

    async def main() -> None:
        local = allocate_shared_tensor(big.shape, torch.bfloat16)
        peer = PeerProcess(PeerSpec("doomed", big.total_bytes, backends=["tcp"]))
        shm_file = SHM_DIR / peer.start()["regions"][POOL_REGION]["shm_name"]
        try:
            async with TransferAgent("decode", ["tcp"]) as agent:
                agent.register(local.region("kv"))
                proxy = FaultyProxy(_tcp_address(peer.metadata), delay_per_chunk=0.005)  # a slow link
                agent.add_remote(proxy.redirect(peer.metadata, await proxy.start()))
                src, dst = kv_pair_descriptors(big, POOL_REGION, range(256), big, "kv", range(256))
                handle = agent.read("doomed", src, dst)
                await proxy.started_forwarding.wait()
                await asyncio.to_thread(peer.kill)
                assert await handle.wait() is TransferStatus.FAILED
                assert "peer closed the connection" in handle.reason
                await proxy.close()
        finally:
            local.close()
            Path(shm_file).unlink(missing_ok=True)  # SIGKILL ran no cleanup in the peer

    run(main())


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_timeout_and_cancel_fail_the_handle(backend: str) -> None:
    async def main() -> None:
        async with agent_pair(seed=4) as pair:
            metadata = pair.prefill.metadata()
            proxy = FaultyProxy(_tcp_address(metadata), stall_after=100)
            pair.decode.add_remote(proxy.redirect(metadata, await proxy.start()))
            src, dst = kv_pair_descriptors(LAYOUT, "kv", ALL_BLOCKS, LAYOUT, "kv", ALL_BLOCKS)
            if backend == "tcp":  # a stalled link (shm cannot stall: it is a memcpy)
                handle = pair.decode.read("prefill", src, dst, timeout=0.2, backend="tcp")
                assert await handle.wait() is TransferStatus.FAILED and handle.reason == "timed out after 0.2 s"
                handle = pair.decode.read("prefill", src, dst, backend="tcp")
                await proxy.started_forwarding.wait()
            else:
                handle = pair.decode.read("prefill", src, dst, backend="shm")
            handle.cancel()
            assert await handle.wait() is TransferStatus.FAILED and handle.reason == "cancelled"
            await proxy.close()

    run(main())


def test_closed_peer_server_fails_the_handle() -> None:
    async def main() -> None:
        async with agent_pair(backends=("tcp",)) as pair:
            await pair.prefill.close()
            src = kv_block_descriptors(LAYOUT, "kv", [1])
            handle = pair.decode.read("prefill", src, src)
            assert await handle.wait() is TransferStatus.FAILED and "ConnectionRefusedError" in handle.reason

    run(main())
