"""Descriptors for KV-cache blocks of the engine's pool layout.

The engine keeps its whole KV cache in one tensor
`[layers, 2, num_blocks, block_size, kv_heads, head_dim]` (see `engine.attention`), so block b's
K (or V) for one layer is one contiguous run of `block_bytes` bytes at
`((layer * 2 + kv) * num_blocks + b) * block_bytes`. Moving a set of blocks is therefore
`layers * 2` runs per block, and consecutive block ids merge into one run.

- `kv_block_descriptors(layout, region, block_ids)`: one side's bytes for `block_ids`, in the
  canonical stream order (layer, then K/V, then the ids in the order given). The prefill side
  uses it to checksum what it hands off.
- `kv_pair_descriptors(src_layout, src_region, src_ids, dst_layout, dst_region, dst_ids)`: the
  matching (source, destination) lists for moving `src_ids[i]` into `dst_ids[i]`, merged where
  both id lists run consecutively. Same stream order, so the checksums agree.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tokenmill.transfer.descriptors import Descriptor

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
               "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and dtype of a KV pool tensor `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KV dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        for field in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"KVLayout.{field} must be positive, got {getattr(self, field)}")

    @classmethod
    def of_tensor(cls, kv_cache: Any) -> KVLayout:
        """The layout of an engine KV cache tensor (anything with `.shape` and a torch-like `.dtype`)."""
        if len(kv_cache.shape) != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"expected [layers, 2, blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
        layers, _, blocks, block_size, heads, dim = (int(x) for x in kv_cache.shape)
        return cls(layers, blocks, block_size, heads, dim, str(kv_cache.dtype).removeprefix("torch."))

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> KVLayout:
        return cls(**obj)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K (or V) for one layer: one contiguous run."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies over all layers, K and V."""
        return self.block_bytes * self.num_layers * 2

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def run_offset(self, layer: int, kv: int, block: int) -> int:
        return ((layer * 2 + kv) * self.num_blocks + block) * self.block_bytes


def kv_block_descriptors(layout: KVLayout, region: str, block_ids: Sequence[int]) -> list[Descriptor]:
    """`block_ids`' bytes in stream order, consecutive ids merged."""
    ids = _checked_ids(layout, block_ids, "block_ids")
    return _expand(layout, region, _run_bounds(ids), ids)


def kv_pair_descriptors(src_layout: KVLayout, src_region: str, src_ids: Sequence[int],
                        dst_layout: KVLayout, dst_region: str,
                        dst_ids: Sequence[int]) -> tuple[list[Descriptor], list[Descriptor]]:
    """(source, destination) lists moving block `src_ids[i]` into block `dst_ids[i]`."""
    if (src_layout.num_layers, src_layout.block_bytes) != (dst_layout.num_layers, dst_layout.block_bytes):
        raise ValueError(f"KV layouts differ per block: source {src_layout}, destination {dst_layout}")
    src = _checked_ids(src_layout, src_ids, "source block ids")
    dst = _checked_ids(dst_layout, dst_ids, "destination block ids")
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    starts = np.union1d(_run_bounds(src)[:-1], _run_bounds(dst)[:-1])  # runs consecutive on both sides
    bounds = np.append(starts, len(src))
    return _expand(src_layout, src_region, bounds, src), _expand(dst_layout, dst_region, bounds, dst)


def _checked_ids(layout: KVLayout, block_ids: Sequence[int], what: str) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= layout.num_blocks):
        raise ValueError(f"{what} must lie in [0, {layout.num_blocks}), got {int(ids.min())}..{int(ids.max())}")
    return ids


def _run_bounds(ids: np.ndarray) -> np.ndarray:
    """Indices where runs of consecutive ids start, plus len(ids) at the end."""
    if not ids.size:
        return np.zeros(1, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    return np.concatenate(([0], breaks, [ids.size])).astype(np.int64)


def _expand(layout: KVLayout, region: str, bounds: np.ndarray, ids: np.ndarray) -> list[Descriptor]:
    first_ids = ids[bounds[:-1]].tolist() if ids.size else []
    run_blocks = np.diff(bounds).tolist()
    out: list[Descriptor] = []
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            base = layout.run_offset(layer, kv, 0)
            out.extend(Descriptor(region, base + first * layout.block_bytes, count * layout.block_bytes)
                       for first, count in zip(first_ids, run_blocks))
    return out
