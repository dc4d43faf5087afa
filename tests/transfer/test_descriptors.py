"""Descriptor validation, coalescing, wire encoding and KV-block descriptors."""
from __future__ import annotations

import pytest
import torch

from tests.transfer.helpers import LAYOUT, agent_pair, run
from tokenmill.transfer import (
    Descriptor,
    KVLayout,
    TransferStatus,
    coalesce,
    coalesce_pairs,
    kv_block_descriptors,
    kv_pair_descriptors,
    validate_descriptors,
)
from tokenmill.transfer.descriptors import decode_descriptors, encode_descriptors


def test_validation_names_the_unregistered_region() -> None:
    with pytest.raises(ValueError, match=r"region 'kv2' is not registered with agent 'decode' \(registered: kv\)"):
        validate_descriptors([Descriptor("kv", 0, 8), Descriptor("kv2", 0, 8)], {"kv": 64}, "decode")


@pytest.mark.parametrize("offset,length", [(60, 8), (-1, 4), (0, 0), (64, 1)])
def test_validation_rejects_out_of_range_bytes(offset: int, length: int) -> None:
    with pytest.raises(ValueError, match=rf"descriptor 0: bytes \[{offset}, {offset + length}\) of region 'kv' "
                                         r"of agent 'a' are out of range \(region holds 64 bytes\)"):
        validate_descriptors([Descriptor("kv", offset, length)], {"kv": 64}, "a")


def test_agent_rejects_bad_descriptors_at_the_call() -> None:
    async def main() -> None:
        async with agent_pair() as pair:
            end = LAYOUT.total_bytes
            good = Descriptor("kv", 0, 16)
            with pytest.raises(ValueError, match="region 'nope' is not registered with agent 'prefill'"):
                pair.decode.read("prefill", [Descriptor("nope", 0, 16)], [good])
            with pytest.raises(ValueError, match=f"bytes \\[{end - 8}, {end + 8}\\) of region 'kv' of agent 'decode'"):
                pair.decode.read("prefill", [good], [Descriptor("kv", end - 8, 16)])
            with pytest.raises(ValueError, match="pair 0: source moves 16 bytes, destination holds 8"):
                pair.decode.read("prefill", [good], [Descriptor("kv", 0, 8)])
            with pytest.raises(ValueError, match="does not know peer 'ghost'"):
                pair.decode.read("ghost", [good], [good])
            with pytest.raises(ValueError, match="no udp backend"):
                pair.decode.read("prefill", [good], [good], backend="udp")

    run(main())


def test_server_revalidates_what_a_peer_asks_for() -> None:
    """A peer whose metadata overstates a region gets a FAILED handle naming the bad bytes."""
    async def main() -> None:
        async with agent_pair() as pair:
            lying = pair.prefill.metadata()
            lying["regions"]["kv"]["length"] *= 2
            pair.decode.add_remote(lying)
            beyond = Descriptor("kv", LAYOUT.total_bytes, 16)
            handle = pair.decode.read("prefill", [beyond], [Descriptor("kv", 0, 16)], backend="tcp")
            assert await handle.wait() is TransferStatus.FAILED
            assert "refused the read" in handle.reason and "out of range" in handle.reason

    run(main())


def test_coalesce_pairs_merges_only_where_both_sides_continue() -> None:
    src = [Descriptor("a", 0, 8), Descriptor("a", 8, 8), Descriptor("a", 16, 8), Descriptor("b", 24, 8)]
    dst = [Descriptor("x", 100, 8), Descriptor("x", 108, 8), Descriptor("x", 200, 8), Descriptor("x", 208, 8)]
    merged_src, merged_dst = coalesce_pairs(src, dst)
    assert merged_src == [Descriptor("a", 0, 16), Descriptor("a", 16, 8), Descriptor("b", 24, 8)]
    assert merged_dst == [Descriptor("x", 100, 16), Descriptor("x", 200, 8), Descriptor("x", 208, 8)]
    assert coalesce(src) == [Descriptor("a", 0, 24), Descriptor("b", 24, 8)]


def test_descriptor_wire_encoding_round_trips_and_rejects_garbage() -> None:
    descs = [Descriptor("kv", 0, 4096), Descriptor("other", 1 << 40, 7), Descriptor("kv", 12, 1)]
    assert decode_descriptors(encode_descriptors(descs)) == descs
    with pytest.raises(ValueError, match="not a whole number"):
        decode_descriptors({"regions": ["kv"], "table": b"\x00" * 10})
    with pytest.raises(ValueError, match="region index outside"):
        decode_descriptors({"regions": [], "table": b"\x00" * 24})


def test_kv_descriptors_address_the_engine_layout() -> None:
    kv = torch.arange(LAYOUT.total_bytes // 2, dtype=torch.int16).view(LAYOUT.shape)
    layout = KVLayout.of_tensor(kv.view(torch.bfloat16))
    assert layout == LAYOUT
    flat = kv.view(torch.uint8).reshape(-1)
    descs = kv_block_descriptors(layout, "kv", [7, 8, 9, 2])
    assert len(descs) == layout.num_layers * 2 * 2  # runs [7, 8, 9] and [2] per layer and K/V
    stream = b"".join(flat[d.offset:d.offset + d.length].numpy().tobytes() for d in descs)
    assert stream == kv[:, :, [7, 8, 9, 2]].contiguous().view(torch.uint8).numpy().tobytes()


def test_kv_pair_descriptors_merge_joint_runs_only() -> None:
    src, dst = kv_pair_descriptors(LAYOUT, "kv", [0, 1, 2, 3], LAYOUT, "kv", [10, 11, 20, 21])
    assert len(src) == len(dst) == LAYOUT.num_layers * 2 * 2
    assert [d.length for d in src[:2]] == [2 * LAYOUT.block_bytes] * 2
    contiguous, _ = kv_pair_descriptors(LAYOUT, "kv", range(5, 25), LAYOUT, "kv", range(30, 50))
    assert len(contiguous) == LAYOUT.num_layers * 2
    other = KVLayout(LAYOUT.num_layers, 8, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim, "float32")
    with pytest.raises(ValueError, match="KV layouts differ per block"):
        kv_pair_descriptors(LAYOUT, "kv", [0], other, "kv", [0])
    with pytest.raises(ValueError, match=r"destination block ids must lie in \[0, 64\)"):
        kv_pair_descriptors(LAYOUT, "kv", [0], LAYOUT, "kv", [64])
