"""Block hashing: the one definition every part of tokenmill shares (ARCHITECTURE.md, "Block hashing").

A prompt is cut into full blocks of `block_size` tokens; a trailing partial block
is never hashed. For block i:

    local[i] = xxh3_64(uint32-LE bytes of the block's tokens, seed)
    h[0]     = local[0]
    h[i]     = xxh3_64(h[i-1] as 8 LE bytes || local[i] as 8 LE bytes, seed)

An optional extra key (LoRA name, cache salt, model id) is folded into the seed
of block 0 only, so different namespaces never share a chain.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

DEFAULT_BLOCK_SIZE = 16
DEFAULT_SEED = 0
_MASK64 = (1 << 64) - 1


def fold_extra_key(seed: int, extra_key: str | bytes | None) -> int:
    """Seed for block 0's local hash: `seed` itself, or `seed` mixed with the extra key."""
    if extra_key is None:
        return seed
    raw = extra_key.encode() if isinstance(extra_key, str) else bytes(extra_key)
    return xxhash.xxh3_64_intdigest(raw, seed=seed)


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32 to be hashed")
    return arr.astype("<u4").tobytes()


def chain_hash(parent: int | None, local: int, seed: int = DEFAULT_SEED) -> int:
    """The chained hash of a block given its parent's chained hash and its local hash."""
    if parent is None:
        return local
    payload = (parent & _MASK64).to_bytes(8, "little") + (local & _MASK64).to_bytes(8, "little")
    return xxhash.xxh3_64_intdigest(payload, seed=seed)


def hash_block(
    parent: int | None,
    block_tokens: Sequence[int],
    seed: int = DEFAULT_SEED,
    extra_key: str | bytes | None = None,
) -> int:
    """Chained hash of one full block. `extra_key` only matters for block 0 (parent None)."""
    local_seed = fold_extra_key(seed, extra_key) if parent is None else seed
    local = xxhash.xxh3_64_intdigest(_tokens_bytes(block_tokens), seed=local_seed)
    return chain_hash(parent, local, seed)


def block_hashes(
    tokens: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = DEFAULT_SEED,
    extra_key: str | bytes | None = None,
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of every full block of `tokens`.

    With `parent`, `tokens` continue a chain whose last block hash is `parent`
    (so the extra key, which only seeds block 0, is not applied again).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = _tokens_bytes(tokens)
    stride = 4 * block_size
    hashes: list[int] = []
    prev = parent
    for start in range(0, (len(data) // stride) * stride, stride):
        local_seed = fold_extra_key(seed, extra_key) if prev is None else seed
        local = xxhash.xxh3_64_intdigest(data[start:start + stride], seed=local_seed)
        prev = chain_hash(prev, local, seed)
        hashes.append(prev)
    return hashes
