"""Block chains for the fleet simulator: xxh3_64 of 16 bytes, vectorised, and chained hashes.

`xxh3_pair(a, b, seed)` is `xxhash.xxh3_64` of `pack("<QQ", a, b)` reproduced bit for bit in
numpy (its 9-16 byte path, default secret; tested against `xxhash` itself), element-wise over
uint64 arrays, so a whole trace's blocks hash at once instead of one Python call per block.
The chains it builds are the ones `tokenmill.kv.hashing.chain_hash` builds:
`xxh3_pair(parent, local)` is `chain_hash(parent, local)`, `h[0] = local[0]`,
`h[i] = chain_hash(h[i-1], local[i])` (chain seed 0).

`chain_blocks` runs the chain over block positions, with all requests that have a block at a
position in one vector; `split_chains` turns that position-major layout back into per-request
tuples. `Blocks.local` gives a position's local hashes (the rules are in the docstring of
`sim.fleet.arrivals`). Unique (padding) blocks use `pack("<QQ", 2**64 - 1 - request_index,
block_index)` as their local input, which no hash id (< 2**63) can produce.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.sim.fleet.trace_rows import Rows

# ---------------------------------------------------------------------------------------------
# Vectorised xxh3_64 of 16 bytes, and the chains


_BITFLIP1 = np.uint64(0x6782737BEA4239B9)  # readLE64(kSecret + 24) ^ readLE64(kSecret + 32)
_BITFLIP2 = np.uint64(0xAF56BC3B0996523A)  # readLE64(kSecret + 40) ^ readLE64(kSecret + 48)
_PRIME_MX1 = np.uint64(0x165667919E3779F9)
_LOW32 = np.uint64(0xFFFFFFFF)
_SIXTEEN = np.uint64(16)


def _mul128_fold64(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Low 64 bits XOR high 64 bits of the 128-bit products x * y (xxh3's mul128_fold64).

    Four 32 x 32 → 64-bit products, as xxhash's portable path; in place where it can be,
    since this is the hot loop of every chain.
    """
    x_lo, x_hi, y_lo, y_hi = x & _LOW32, x >> 32, y & _LOW32, y >> 32
    lo_lo = x_lo * y_lo
    hi_lo = x_hi * y_lo
    x_lo *= y_hi  # lo_hi
    x_hi *= y_hi  # hi_hi
    cross = lo_lo >> 32
    cross += hi_lo & _LOW32
    cross += x_lo  # cannot overflow
    hi_lo >>= 32
    hi_lo += x_hi
    hi_lo += cross >> 32  # the upper 64 bits
    cross <<= 32
    lo_lo &= _LOW32
    cross |= lo_lo  # the lower 64 bits
    hi_lo ^= cross
    return hi_lo


def xxh3_pair(a: np.ndarray, b: np.ndarray, seed: np.ndarray | None = None) -> np.ndarray:
    """xxh3_64 of `pack("<QQ", a, b)` with `seed` (0 if None), element-wise over uint64 arrays.

    Bit-exact with `xxhash.xxh3_64_intdigest` (its 9-16 byte path, default secret), so
    `xxh3_pair(parent, local)` is `kv.hashing.chain_hash(parent, local)`.
    """
    flip1 = _BITFLIP1 if seed is None else _BITFLIP1 + seed
    flip2 = _BITFLIP2 if seed is None else _BITFLIP2 - seed
    lo, hi = a ^ flip1, b ^ flip2
    acc = _mul128_fold64(lo, hi)
    acc += _SIXTEEN
    acc += lo.byteswap(inplace=True)
    acc += hi
    acc ^= acc >> 37
    acc *= _PRIME_MX1
    acc ^= acc >> 32
    return acc


@dataclass(slots=True)
class Blocks:
    """Local hashes of block position `i` for the `count` longest requests (sorted order).

    `row`, `copy` and `pad` are per request, sorted by block count, longest first, so the
    requests that have a block at position i are always a prefix of that order.
    """
    rows: Rows
    row: np.ndarray   # int64: the trace row each request replays
    copy: np.ndarray  # uint64: its copy index (block 0's local seed)
    pad: np.ndarray   # uint64: 2**64 - 1 - request index, the input of its unique blocks
    block_size: int
    tokens_per_hash_block: int

    def local(self, i: int, count: int) -> np.ndarray:
        """Block i's local hashes: (hash id, sub-block) inside ids, (pad, i) touching padding."""
        tpb, size = self.tokens_per_hash_block, self.block_size
        first, last = i * size // tpb, (i * size + size - 1) // tpb
        row = self.row[:count]
        covered = self.rows.hid_count[row] > last  # the whole block lies inside hash ids
        content = self._hash_id(row, first, covered)
        if tpb % size == 0:
            tag = np.uint64((i * size % tpb) // size)  # sub-block j of its hash id
        else:
            for k in range(first + 1, last + 1):
                content = xxh3_pair(content, self._hash_id(row, k, covered))
            tag = np.uint64(((i * size % tpb) << 32) | (last - first + 1))  # offset, ids spanned
        a = np.where(covered, content, self.pad[:count])
        b = np.where(covered, tag, np.uint64(i))
        return xxh3_pair(a, b, self.copy[:count] if i == 0 else None)

    def _hash_id(self, row: np.ndarray, k: int, covered: np.ndarray) -> np.ndarray:
        """Hash id k of each row (the sentinel where the row is not covered)."""
        index = np.where(covered, self.rows.hid_start[row] + k, len(self.rows.hid_flat) - 1)
        return self.rows.hid_flat[index]


def chain_blocks(blocks: Blocks, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Chained hashes of every block, position-major, and where each position starts.

    `lengths` (blocks per request) must be sorted longest first, so the requests with a block
    at position i are the first `counts[i]`, stored at `offsets[i]:offsets[i] + counts[i]`
    in that order: block i's parent is at the same rank of position i-1. `split_chains` undoes
    it.
    """
    counts = np.searchsorted(-lengths, -np.arange(int(lengths[0]) if len(lengths) else 0), side="left")
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    hashes = np.empty(int(offsets[-1]), dtype=np.uint64)
    for i, count in enumerate(counts.tolist()):
        local = blocks.local(i, count)
        start = offsets[i]
        if i == 0:
            hashes[:count] = local
        else:
            previous = offsets[i - 1]
            hashes[start:start + count] = xxh3_pair(hashes[previous:previous + count], local)
    return hashes, offsets


def split_chains(hashes: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                 chunk: int = 8192) -> list[tuple[int, ...]]:
    """Per-request tuples (in sorted order) from the position-major layout of `chain_blocks`."""
    out: list[tuple[int, ...]] = []
    for lo in range(0, len(lengths), chunk):
        part = lengths[lo:lo + chunk]
        starts = np.concatenate([[0], np.cumsum(part)]).astype(np.int64)
        position = np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1], part)
        rank = np.repeat(np.arange(lo, lo + len(part), dtype=np.int64), part)
        values = hashes[offsets[position] + rank].tolist()
        out.extend(tuple(values[s:e]) for s, e in zip(starts[:-1].tolist(), starts[1:].tolist()))
    return out
