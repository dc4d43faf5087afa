"""The contract every KV tier keeps, and the data a tier stores per block.

A tier maps a block's chained hash (`tokenmill.kv.hashing`) to the block's KV
payload (raw bytes: `kv[:, :, block_id]` of the engine's cache, see
`tokenmill.kv.tiers.payload`) plus `BlockMeta` (parent hash, token ids).

Rules every tier follows:
- `get` never returns wrong bytes: each stored block carries an xxh3_64 checksum
  of its payload, verified on load. A checksum mismatch, a missing file or a
  backend that is down is a *miss* (counted in `TierStats`), never an exception.
- `put` returns False instead of raising when the block cannot be stored
  (no room left that may be evicted, backend down); the caller just moves on.
- Capacity is a hard bound on `used_bytes`. Eviction (LRU by default, LFU
  optional) never evicts a block while a child of it is stored in the same tier,
  and never evicts a pinned block (`pin`/`unpin`, up to a cap per tier).
- Tiers emit tier-tagged `stored`/`removed` KV events through the worker's shared
  `KVEventEmitter` (attribute `events`, may be None).
- Tiers are safe to use from two threads (the engine reading, the offload thread
  writing); stats counters are plain ints, exact per thread, approximate across.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

from tokenmill.kv.events import KVEventEmitter

SHARED_TIERS: tuple[str, ...] = ("host", "disk", "shared")


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """What a tier keeps next to a payload: where the block hangs in its chain and its tokens
    (so a hash collision is caught when the block is onboarded)."""
    parent: int | None
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class TierStats:
    """Counters for `/metrics`. Latencies are sums in seconds; divide by the matching count."""
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # checksum or format mismatches (each is also a miss)
    errors: int = 0  # backend failures: I/O errors, connection refused (gets among them are misses)
    puts: int = 0
    rejected: int = 0  # puts refused for lack of evictable room
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    get_seconds: float = 0.0
    put_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@runtime_checkable
class Tier(Protocol):
    """One storage level below the device pool: `host`, `disk` or `shared`."""

    name: str
    stats: TierStats
    events: KVEventEmitter | None

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def put(self, block_hash: int, payload: bytes, meta: BlockMeta) -> bool:
        """Store a block (a no-op refresh when already present); False when it could not be."""
        ...

    def get(self, block_hash: int) -> tuple[bytes, BlockMeta] | None:
        """The verified payload and meta, or None (a counted miss)."""
        ...

    def contains(self, block_hash: int) -> bool: ...

    def contains_many(self, hashes: Sequence[int]) -> list[bool]:
        """`contains` for many hashes in one go (one round trip on remote tiers)."""
        ...

    def delete(self, block_hash: int) -> bool: ...

    def pin(self, hashes: Iterable[int]) -> bool:
        """Never evict these hashes from this tier (now or once stored); False, changing
        nothing, when the tier's pin cap would be exceeded."""
        ...

    def unpin(self, hashes: Iterable[int]) -> None: ...

    def hashes(self) -> list[int]:
        """Every hash this tier holds (for snapshots and tests)."""
        ...

    def close(self) -> None: ...


def validate_tier_name(name: str) -> str:
    if name not in SHARED_TIERS:
        raise ValueError(f"a tier is one of {SHARED_TIERS}, got {name!r}")
    return name


def validate_capacity(capacity_bytes: int) -> int:
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
    return capacity_bytes
