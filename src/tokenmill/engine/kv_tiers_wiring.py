"""The engine's side of the KV tiers: build the `TieredKVManager` from `EngineConfig`, copy
evicted device blocks out, onboard tier hits into fresh device blocks, pin prefixes.

- **Offload**: the block pool's `on_evict` hook snapshots each evicted block (one gather
  copy on the engine thread) and queues it; the manager's thread serializes and stores.
- **Onboard**: `KVCacheManager` calls `lookup`/`load_into` (the `TierSource` protocol)
  at admission; payloads are verified by the tiers (checksum, token ids) and a payload
  that does not fit the cache layout is a miss, so a bad block is recomputed.
- **Tiers**: `kv_host_gb` → host; `kv_disk_dir` → disk under `<dir>/<worker_id>` (so the
  workers of one `tokenmill serve` never share files); `kv_shared` → Redis when it is a
  `redis://` URL, else a shared directory. Shared blocks are namespaced by model and KV
  layout, so only engines with the same checkpoint layout meet.
- **Write-through** (`kv_write_through`, needs `kv_shared`): every block is offloaded as
  soon as it is computed (seen as a device `stored` event), not only on eviction, so other
  replicas find it in the shared tier at once. Onboarded blocks are not written back.
- **Pin file** (`kv_pin_file`): JSON lines, each a prompt string (tokenized as
  `/v1/completions` does) or a list of token ids; blank lines and
  lines starting with `#` are skipped. Only full blocks are pinned.

The mock runner holds no KV, so `EngineConfig` refuses tiers with it.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.kv.block_pool import KVBlock
from tokenmill.kv.events import BlockStored
from tokenmill.kv.hashing import block_hashes
from tokenmill.kv.tiered_manager import OffloadBlock, TieredKVManager
from tokenmill.kv.tiers.payload import snapshot_block, write_block_payload

if TYPE_CHECKING:
    from tokenmill.engine.config import EngineConfig
    from tokenmill.kv.block_pool import BlockPool
    from tokenmill.kv.events import KVEventEmitter
    from tokenmill.textgen.model_config import ModelConfig

log = logging.getLogger(__name__)
GIB = 2**30
DEFAULT_DISK_GB = 4.0
DEFAULT_SHARED_GB = 1.0


def build_manager(config: EngineConfig, model_config: ModelConfig, events: KVEventEmitter) -> TieredKVManager:
    """The tiers `config` asks for (the caller checks `config.kv_tiers_enabled`)."""
    from tokenmill.kv.tiers.disk import DiskTier
    from tokenmill.kv.tiers.host import HostTier

    host = HostTier(int(config.kv_host_gb * GIB)) if config.kv_host_gb else None
    disk = None
    if config.kv_disk_dir:
        disk = DiskTier(Path(config.kv_disk_dir) / config.worker_id, int((config.kv_disk_gb or DEFAULT_DISK_GB) * GIB))
    shared = _shared_tier(config, model_config) if config.kv_shared else None
    return TieredKVManager(host, disk, shared, events=events, write_through=config.kv_write_through)


def _shared_tier(config: EngineConfig, model_config: ModelConfig) -> Any:
    capacity = int((config.kv_shared_gb or DEFAULT_SHARED_GB) * GIB)
    url = config.kv_shared or ""
    if url.startswith("redis://"):
        from tokenmill.kv.tiers.redis_tier import RedisTier, namespace_for

        layout = (f"L{model_config.num_layers}-kvh{model_config.num_kv_heads}-hd{model_config.head_dim}"
                  f"-bs{config.block_size}-{config.torch_dtype(model_config)}-seed{config.hash_seed}")
        model = Path(config.model).resolve().name
        return RedisTier(url, namespace_for(model, layout), capacity)
    from tokenmill.kv.tiers.shared_dir import SharedDirTier

    return SharedDirTier(url, capacity)


class EngineTiers:
    """Connects one engine's block pool and KV tensor to a `TieredKVManager`. While `enabled` is
    False (an operator turned the managed cache off) nothing is stored to the tiers or loaded
    from them; what they hold stays for when it is turned on again."""

    def __init__(self, manager: TieredKVManager, pool: BlockPool, kv_cache: torch.Tensor,
                 hash_seed: int) -> None:
        self.manager = manager
        self.pool = pool
        self.kv_cache = kv_cache
        self.hash_seed = hash_seed
        self.bad_payloads = 0
        self.enabled = True  # switched on the engine thread (LLMEngine.set_tiers_enabled), between steps
        self._just_loaded: set[int] = set()
        pool.on_evict = self.offload
        if manager.write_through and manager.shared is not None and pool.events is not None:
            pool.events.subscribe(self._write_through)

    def _write_through(self, event: Any) -> None:
        """Device `stored` events (engine thread): offload the newly computed blocks now."""
        if not isinstance(event, BlockStored) or event.tier != self.pool.tier:
            return
        blocks = [self.pool.cached[h] for h in event.hashes if h in self.pool.cached and h not in self._just_loaded]
        self._just_loaded.clear()
        if blocks:
            self.offload(blocks)

    # -- offload (pool.on_evict, engine thread) ------------------------------------------
    def offload(self, blocks: list[KVBlock]) -> None:
        if not self.enabled:
            return
        batch = [OffloadBlock(b.block_hash, b.parent_hash, b.token_ids or (), snapshot_block(self.kv_cache, b.block_id))
                 for b in blocks if b.block_hash is not None]
        self.manager.offload(batch)

    # -- onboard (TierSource, called by KVCacheManager at admission) -----------------------
    def lookup(self, hashes: Sequence[int]) -> int:
        return len(self.manager.lookup(hashes)) if hashes and self.enabled else 0

    def load_into(self, blocks: Sequence[KVBlock], hashes: Sequence[int],
                  tokens: Sequence[Sequence[int]]) -> int:
        payloads = self.manager.load(hashes, tokens)
        self._just_loaded.update(hashes[:len(payloads)])
        for i, (block, payload) in enumerate(zip(blocks, payloads)):
            try:
                write_block_payload(self.kv_cache, block.block_id, payload)
            except ValueError:
                self.bad_payloads += 1
                log.warning("tier payload for block %x does not fit this cache; recomputing", hashes[i])
                return i
        return min(len(blocks), len(payloads))

    # -- pinning ----------------------------------------------------------------------------
    def pin_prefix(self, token_ids: Sequence[int]) -> bool:
        """Pin the full blocks of `token_ids` in every tier; blocks already on the device are
        offloaded now, so the tiers (and the shared tier, for other replicas) hold them."""
        hashes = block_hashes(list(token_ids), self.pool.block_size, self.hash_seed)
        if not hashes or not self.manager.pin(hashes):
            return False
        on_device = [self.pool.cached[h] for h in hashes if h in self.pool.cached]
        if on_device:
            self.offload(on_device)
        return True

    def stats(self) -> dict[str, Any]:
        return {**self.manager.stats(), "bad_payloads": self.bad_payloads}

    def close(self) -> None:
        self.manager.close()


TIER_LOAD_KEYS = ("hits", "misses", "corrupt", "errors", "used_bytes", "capacity_bytes", "bytes_in", "bytes_out")


def tier_load(tier_stats: dict[str, Any]) -> dict[str, float]:
    """Tier stats flattened for a worker's heartbeat load: `tier_<tier>_<metric>` (the frontend
    turns them into `tokenmill_worker_kv_tier_<metric>{worker,tier}` gauges)."""
    load = {f"tier_{name}_{key}": float(tier[key])
            for name, tier in tier_stats.get("tiers", {}).items() for key in TIER_LOAD_KEYS if key in tier}
    for key in ("onboard_blocks", "offload_stored", "offload_dropped"):
        if key in tier_stats:
            load[f"kv_{key}"] = float(tier_stats[key])
    return load


def read_pin_file(path: str, tokenize: Any) -> list[list[int]]:
    """Token-id lists from a pin file (format in the module docstring); `tokenize(str)`
    turns prompt strings into ids. ValueError names the file and line."""
    prefixes: list[list[int]] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_pin_file {path}:{number}: not JSON ({exc.msg})") from exc
        if isinstance(item, str):
            prefixes.append(list(tokenize(item)))
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            prefixes.append(item)
        else:
            raise ValueError(f"kv_pin_file {path}:{number}: expected a string or a list of token ids")
    return prefixes


def attach_tiers(engine: Any) -> EngineTiers:
    """Build the tiers for an `LLMEngine` (torch runner), hook them into its pool and KV
    manager, and pin the prefixes of `kv_pin_file`."""
    config = engine.config
    manager = build_manager(config, engine.model_config, engine.events)
    tiers = EngineTiers(manager, engine.pool, engine.runner.kv_cache, config.hash_seed)
    engine.kv.tiers = tiers
    if config.kv_pin_file:
        tokenizer = engine.tokenizer
        if tokenizer is None:
            prefixes = read_pin_file(config.kv_pin_file, _no_tokenizer)
        else:
            prefixes = read_pin_file(config.kv_pin_file, tokenizer.encode)
        pinned = sum(tiers.pin_prefix(prefix) for prefix in prefixes)
        log.info("pinned %d of %d prefixes from %s", pinned, len(prefixes), config.kv_pin_file)
    return tiers


def _no_tokenizer(text: str) -> list[int]:
    raise ValueError("kv_pin_file has prompt strings but the engine has no tokenizer; use token-id lists")
