"""Random block sets round-trip bit-exactly over shm and tcp, in one process and across two."""
from __future__ import annotations

import random

import pytest
import torch

from tests.transfer.helpers import LAYOUT, agent_pair, blocks_bytes, random_block_sets, random_pool, run
from tokenmill.transfer import (
    SharedBuffer,
    TransferAgent,
    TransferStatus,
    allocate_shared_tensor,
    kv_block_descriptors,
    kv_pair_descriptors,
)
from tokenmill.transfer.descriptors import encode_descriptors
from tokenmill.transfer.peer_process import POOL_REGION, PeerProcess, PeerSpec


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_random_block_sets_round_trip_in_process(backend: str) -> None:
    async def main() -> None:
        rng = random.Random(backend)
        async with agent_pair(seed=1) as pair:
            for _ in range(6):
                src_ids, dst_ids = random_block_sets(rng, LAYOUT.num_blocks, rng.randrange(1, 40))
                src, dst = kv_pair_descriptors(LAYOUT, "kv", src_ids, LAYOUT, "kv", dst_ids)
                expected = pair.prefill.checksum(kv_block_descriptors(LAYOUT, "kv", src_ids))
                pair.target.tensor.zero_()
                handle = pair.decode.read("prefill", src, dst, expected_checksum=expected, backend=backend)
                assert await handle.wait() is TransferStatus.DONE, handle.reason
                assert (handle.backend, handle.bytes) == (backend, len(src_ids) * LAYOUT.bytes_per_block)
                assert blocks_bytes(pair.target, dst_ids) == blocks_bytes(pair.source, src_ids)
                pair.target.tensor.zero_()  # and the same blocks pushed the other way round
                handle = pair.prefill.write("decode", src, dst, backend=backend)
                assert await handle.wait() is TransferStatus.DONE, handle.reason
                assert blocks_bytes(pair.target, dst_ids) == blocks_bytes(pair.source, src_ids)

    run(main())


def test_backend_choice_prefers_shm_on_one_host_and_falls_back_to_tcp() -> None:
    async def main() -> None:
        async with agent_pair() as pair:
            src, dst = kv_pair_descriptors(LAYOUT, "kv", [1, 2], LAYOUT, "kv", [3, 4])
            assert pair.decode.read("prefill", src, dst).backend == "shm"
            elsewhere = pair.prefill.metadata()
            elsewhere["backends"]["shm"]["domain"] = "another-host"
            pair.decode.add_remote(elsewhere)
            handle = pair.decode.read("prefill", src, dst)
            assert handle.backend == "tcp" and await handle.wait() is TransferStatus.DONE

    run(main())


@pytest.fixture(scope="module")
def peer() -> PeerProcess:
    with PeerProcess(PeerSpec("prefill-proc", LAYOUT.total_bytes, seed=7)) as process:
        yield process


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_cross_process_reads_and_writes_are_bit_exact(peer: PeerProcess, backend: str) -> None:
    """The decode agent here pulls from (and pushes to) a prefill agent in another process."""
    async def main() -> None:
        rng = random.Random(f"x-{backend}")
        local = allocate_shared_tensor(LAYOUT.shape, torch.bfloat16)
        remote_view = SharedBuffer.attach(peer.metadata["regions"][POOL_REGION]["shm_name"], LAYOUT.total_bytes)
        try:
            async with TransferAgent("decode", [backend]) as agent:
                agent.register(local.region("kv"))
                name = agent.add_remote(peer.metadata)
                for _ in range(4):
                    src_ids, dst_ids = random_block_sets(rng, LAYOUT.num_blocks, rng.randrange(1, 48))
                    src, dst = kv_pair_descriptors(LAYOUT, POOL_REGION, src_ids, LAYOUT, "kv", dst_ids)
                    reply = await peer.call_async(
                        "checksum", descs=encode_descriptors(kv_block_descriptors(LAYOUT, POOL_REGION, src_ids)))
                    handle = agent.read(name, src, dst, expected_checksum=reply["checksum"])
                    assert await handle.wait() is TransferStatus.DONE, handle.reason
                    assert _remote_blocks(remote_view, src_ids) == blocks_bytes(local, dst_ids)
                    # push them back to other blocks of the peer's pool; check with the peer's own hash
                    back_ids = rng.sample(range(LAYOUT.num_blocks), len(dst_ids))
                    local_src, remote_dst = kv_pair_descriptors(LAYOUT, "kv", dst_ids, LAYOUT, POOL_REGION, back_ids)
                    handle = agent.write(name, local_src, remote_dst)
                    assert await handle.wait() is TransferStatus.DONE, handle.reason
                    after = await peer.call_async("checksum", descs=encode_descriptors(remote_dst))
                    assert after["checksum"] == reply["checksum"]
        finally:
            remote_view.close()
            local.close()

    run(main())


def test_peer_process_pulls_from_this_process_over_shm(peer: PeerProcess) -> None:
    async def main() -> None:
        source = random_pool(LAYOUT, seed=3)
        try:
            async with TransferAgent("prefill-here", ["shm"]) as agent:
                agent.register(source.region("kv"))
                ids = list(range(10, 30))
                src, dst = kv_pair_descriptors(LAYOUT, "kv", ids, LAYOUT, POOL_REGION, ids)
                reply = await peer.call_async("read", peer=agent.metadata(), remote=encode_descriptors(src),
                                              local=encode_descriptors(dst), backend="shm")
                assert (reply["status"], reply["backend"]) == ("done", "shm"), reply
                landed = await peer.call_async("checksum", descs=encode_descriptors(dst))
                assert landed["checksum"] == agent.checksum(src)
        finally:
            source.close()

    run(main())


def _remote_blocks(view: SharedBuffer, block_ids: list[int]) -> bytes:
    return b"".join(bytes(view.view[d.offset:d.offset + d.length])
                    for d in kv_block_descriptors(LAYOUT, POOL_REGION, block_ids))
