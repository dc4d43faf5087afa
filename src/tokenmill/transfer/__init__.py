"""tokenmill.transfer: move KV blocks (any registered bytes) between workers.

One API over memory kinds and backends (ARCHITECTURE.md, "KV transfer handle"):

- `memory`: `allocate_shared_tensor` (the KV pool in shared memory), `MemoryRegion`,
  `host_region`, `SharedBuffer`.
- `descriptors` / `kv_layout`: `Descriptor(region, offset, length)` lists, validation,
  coalescing; `KVLayout` and `kv_block_descriptors` / `kv_pair_descriptors` for the engine's
  `[layers, 2, blocks, block_size, kv_heads, head_dim]` pool.
- `agent`: `TransferAgent` (register, metadata, add_remote, read, write, checksum, notify).
- `handle`: `TransferHandle` / `TransferStatus` / `Notification`.
- `backends`: `shm` (same host) and `tcp`; the `Backend` protocol admits CUDA/NCCL/UCX later.

Disaggregated flow: the prefill worker allocates its pool with `allocate_shared_tensor`,
registers `pool.region("kv")`, publishes `agent.metadata()`, and hands out
`{agent, layout, block_ids, checksum}` with `checksum = agent.checksum(kv_block_descriptors(...))`.
The decode worker `add_remote`s that metadata, builds the pairs with `kv_pair_descriptors`,
`read(..., expected_checksum=checksum, timeout=...)`, and on DONE `notify`s an ACK; the prefill
worker frees its blocks when the ACK arrives (`next_notification`) or after its own timeout.
"""
from tokenmill.transfer.agent import TransferAgent, checksum_views
from tokenmill.transfer.backends import Backend, ShmBackend, TcpBackend
from tokenmill.transfer.descriptors import Descriptor, coalesce, coalesce_pairs, total_bytes, validate_descriptors
from tokenmill.transfer.handle import Notification, TransferError, TransferHandle, TransferStatus
from tokenmill.transfer.kv_layout import KVLayout, kv_block_descriptors, kv_pair_descriptors
from tokenmill.transfer.memory import MemoryRegion, SharedBuffer, SharedTensor, allocate_shared_tensor, host_region

__all__ = [
    "Backend", "Descriptor", "KVLayout", "MemoryRegion", "Notification", "SharedBuffer", "SharedTensor",
    "ShmBackend", "TcpBackend", "TransferAgent", "TransferError", "TransferHandle", "TransferStatus",
    "allocate_shared_tensor", "checksum_views", "coalesce", "coalesce_pairs", "host_region",
    "kv_block_descriptors", "kv_pair_descriptors", "total_bytes", "validate_descriptors",
]
