"""What the connector's scheduler side tells its worker side each step, and the handle a prefill
worker hands out. Plain data: vLLM pickles the step's metadata from its engine core to its worker,
where they are separate processes (its multiprocess executor).

    handle = {"agent": AGENT METADATA, "layout": LAYOUT, "remote_request_id": ID,
              "block_ids": [...], "num_tokens": N, "stamp": stamp(ID)}

- `agent`: the prefill worker process's `TransferAgent.metadata()`; its regions are
  `kv0..kv{L-1}` (each attention layer's cache, `[num_blocks, ...]` with one block's bytes
  contiguous) and `sums` (`[num_blocks, 2]` uint64: a block's xxh3 checksum and the stamp of the
  request that sealed it).
- `block_ids`: the prompt's blocks, held until the decode worker's `{"release": ID}` notification or
  the hold timeout; `num_tokens`: the prompt positions their KV covers.
- A decode worker pulls the blocks it lacks and reads their `sums` rows: every row must carry the
  handle's stamp and the checksum of the bytes that arrived, or the prompt is recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import xxhash

# Plain data, importable without vLLM: connector.py wraps a step's jobs in vLLM's metadata class.


def stamp(request_id: str) -> int:
    """A request's 64-bit stamp on the checksum rows of the blocks it sealed."""
    return xxhash.xxh3_64_intdigest(request_id.encode())


@dataclass(slots=True)
class LoadJob:
    """Decode side: pull `handle`'s blocks from `first_block` on into local `block_ids` (empty: the
    local prefix cache had them all, so only the release is sent)."""
    request_id: str
    handle: dict[str, Any]
    first_block: int
    block_ids: list[int]


@dataclass(slots=True)
class SealJob:
    """Prefill side: once this step has written them, checksum `block_ids` for `request_id`."""
    request_id: str
    block_ids: list[int]


@dataclass(slots=True)
class StepJobs:
    loads: list[LoadJob] = field(default_factory=list)
    seals: list[SealJob] = field(default_factory=list)
    held: list[str] = field(default_factory=list)  # finished, blocks kept for a decode worker's pull
