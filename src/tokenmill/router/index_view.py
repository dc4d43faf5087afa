"""What a router's KV index holds, as JSON: `GET /admin/router/index` (and tests that compare
two frontends' indexes block for block).

Per worker and tier: the block count, an order-free digest of the hashes (xxh3-64 of the sorted
hashes as little-endian u64), and, when asked, the hashes themselves. Two routers fed the same
events hold the same blocks exactly when every (worker, tier) count and digest agree.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from tokenmill.router.indexer import KVIndexer


def hashes_digest(hashes: list[int]) -> str:
    """Order-free digest of a set of 64-bit block hashes."""
    packed = np.sort(np.fromiter(hashes, dtype=np.uint64, count=len(hashes))).astype("<u8").tobytes()
    return xxhash.xxh3_64_hexdigest(packed)


def index_view(indexer: KVIndexer, with_hashes: bool = False) -> dict[str, Any]:
    """{"blocks": n, "workers": {worker: {"last_event_id", "awaiting_snapshot", "tiers": {tier:
    {"blocks", "digest"[, "hashes"]}}}}}; sorted hashes when `with_hashes`."""
    awaiting = set(indexer.awaiting_snapshot())
    workers: dict[str, Any] = {}
    for worker, tiers in sorted(indexer.blocks_by_worker().items()):
        view: dict[str, Any] = {}
        for tier, hashes in sorted(tiers.items()):
            view[tier] = {"blocks": len(hashes), "digest": hashes_digest(hashes)}
            if with_hashes:
                view[tier]["hashes"] = sorted(hashes)
        workers[worker] = {"last_event_id": indexer.last_event_id(worker),
                           "awaiting_snapshot": worker in awaiting, "tiers": view}
    return {"blocks": indexer.num_blocks(), "workers": workers}
