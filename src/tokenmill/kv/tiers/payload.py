"""A block's KV as bytes and back: what tiers store for one device block.

The engine's cache is one tensor `[layers, 2, num_blocks, block_size, kv_heads,
head_dim]` (engine/attention.py); block `b`'s payload is `kv[:, :, b]`, i.e.
2·layers contiguous runs, serialized in that order. The payload carries no
shape: the tier namespace (model + layout) guarantees a reader with the same
layout, and `write_block_payload` checks the size.
"""
from __future__ import annotations

import torch


def snapshot_block(kv: torch.Tensor, block_id: int) -> torch.Tensor:
    """A private copy of one block's KV, cheap enough for the engine's step path (one gather
    copy); the offload thread turns it into bytes later. On CUDA the copy stays on the GPU
    until `block_payload` moves it."""
    _check_block(kv, block_id)
    return kv[:, :, block_id].clone()


def block_payload(block: torch.Tensor) -> bytes:
    """The bytes of a block snapshot (`snapshot_block`) or of `kv[:, :, block_id]`."""
    flat = block.detach().contiguous().to("cpu").view(-1).view(torch.uint8)
    return flat.numpy().tobytes()


def write_block_payload(kv: torch.Tensor, block_id: int, payload: bytes) -> None:
    """Onboard: copy a payload into device block `block_id`."""
    _check_block(kv, block_id)
    target = kv[:, :, block_id]
    expected = target.numel() * target.element_size()
    if len(payload) != expected:
        raise ValueError(f"payload of {len(payload)} bytes does not fit a {expected}-byte block")
    source = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(kv.dtype).view(target.shape)
    target.copy_(source, non_blocking=False)


def _check_block(kv: torch.Tensor, block_id: int) -> None:
    if kv.dim() != 6:
        raise ValueError(f"expected a [layers, 2, blocks, block_size, heads, dim] cache, got {tuple(kv.shape)}")
    if not 0 <= block_id < kv.shape[2]:
        raise ValueError(f"block id {block_id} outside 0..{kv.shape[2] - 1}")
