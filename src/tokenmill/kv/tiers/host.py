"""`HostTier`: KV blocks in CPU memory, the first stop for blocks the device pool evicts.

Payloads are kept as immutable `bytes` (no checksum: memory is not a medium
that tears or rots between our own writes and reads). With `pin_memory=True`
(the default when CUDA is present) each payload lives in a page-locked uint8
tensor, so the onboarding copy to the GPU can be an asynchronous DMA.
"""
from __future__ import annotations

import torch

from tokenmill.kv.events import KVEventEmitter
from tokenmill.kv.tiers.base import BlockMeta
from tokenmill.kv.tiers.indexed import IndexedTier

HostPayload = bytes | torch.Tensor


class HostTier(IndexedTier[tuple[HostPayload, BlockMeta]]):
    def __init__(
        self, capacity_bytes: int, *, policy: str = "lru", max_pinned: int = 4096,
        pin_memory: bool | None = None, events: KVEventEmitter | None = None,
    ) -> None:
        super().__init__("host", capacity_bytes, policy=policy, max_pinned=max_pinned, events=events)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._blocks: dict[int, tuple[HostPayload, BlockMeta]] = {}

    def meta(self, block_hash: int) -> BlockMeta | None:
        """The block's meta without reading its payload (host lookups check token ids with it)."""
        with self._lock:
            stored = self._blocks.get(block_hash)
            return stored[1] if stored else None

    def _prepare(self, block_hash: int, payload: bytes, meta: BlockMeta) -> tuple[
            tuple[HostPayload, BlockMeta], int]:
        stored: HostPayload = bytes(payload)
        if self.pin_memory:
            stored = torch.frombuffer(bytearray(payload), dtype=torch.uint8).pin_memory()
        return (stored, meta), max(len(payload), 1)

    def _write(self, block_hash: int, prepared: tuple[HostPayload, BlockMeta]) -> bool:
        with self._lock:
            self._blocks[block_hash] = prepared
        return True

    def _read(self, block_hash: int) -> tuple[bytes, BlockMeta] | None:
        with self._lock:
            stored = self._blocks.get(block_hash)
        if stored is None:
            return None
        payload, meta = stored
        if isinstance(payload, torch.Tensor):
            return payload.numpy().tobytes(), meta
        return payload, meta

    def _erase(self, block_hash: int) -> None:
        with self._lock:
            self._blocks.pop(block_hash, None)
