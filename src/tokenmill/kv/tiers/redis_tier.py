"""`RedisTier`: the `shared` tier on a real `redis-server`, read and written by every worker.

- Keys live under a namespace that must identify the model and the KV layout
  (dtype, block size, TP rank): `namespace_for(...)`. Chained hashes already
  separate extra keys (LoRA, cache salt).
- A value is one self-verifying record (payload + checksums + meta, record.py);
  a record that does not verify is deleted and counted as corrupt and a miss.
- Capacity, LRU order, children-before-parents and pins are enforced inside
  Redis by one Lua script (redis_script.py), so concurrent workers keep one
  consistent budget. Configure the server with `maxmemory-policy noeviction`
  (or no maxmemory): Redis' own eviction would bypass the index.
- Redis being down is never an exception to the caller: the call is a counted
  error and a miss (or a refused put), and the tier stays quiet for a backoff
  (doubling from `retry_after_s` up to `max_backoff_s`) before it tries again.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenmill.kv.events import KVEventEmitter
from tokenmill.kv.tiers.base import BlockMeta, TierStats, validate_capacity
from tokenmill.kv.tiers.record import CorruptBlock, decode_record, encode_record
from tokenmill.kv.tiers.redis_script import KEY_SUFFIXES, TIER_SCRIPT

log = logging.getLogger(__name__)
T = TypeVar("T")
_FAILED: Any = object()


def namespace_for(model: str, layout: str, prefix: str = "tokenmill") -> str:
    """A key namespace: blocks of different models or KV layouts must never meet."""
    if not model or not layout:
        raise ValueError("model and layout are both needed to namespace shared KV blocks")
    return f"{prefix}:{model}:{layout}"


def _hex(block_hash: int) -> str:
    return f"{block_hash & ((1 << 64) - 1):016x}"


class RedisTier:
    name = "shared"

    def __init__(
        self, url: str, namespace: str, capacity_bytes: int, *, max_pinned: int = 4096,
        timeout_s: float = 0.5, retry_after_s: float = 0.5, max_backoff_s: float = 10.0,
        events: KVEventEmitter | None = None,
    ) -> None:
        if not namespace:
            raise ValueError("a Redis tier needs a namespace (see namespace_for)")
        self.namespace = namespace
        self._capacity = validate_capacity(capacity_bytes)
        self.max_pinned = max_pinned
        self.stats = TierStats()
        self.events = events
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0))  # no hidden retries: the backoff below decides
        self._script = self._client.register_script(TIER_SCRIPT)
        self._keys = [f"{namespace}:{suffix}" for suffix in KEY_SUFFIXES]
        self._blob_prefix = f"{namespace}:b:"
        self._retry_after_s = retry_after_s
        self._max_backoff_s = max_backoff_s
        self._backoff_s = retry_after_s
        self._down_until = 0.0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        raw = self._call(lambda: self._client.get(self._keys[5]))
        return int(raw) if raw not in (None, _FAILED) else 0

    @property
    def available(self) -> bool:
        """False while backing off after a failure."""
        return time.monotonic() >= self._down_until

    def put(self, block_hash: int, payload: bytes, meta: BlockMeta) -> bool:
        start = time.perf_counter()
        record = encode_record(block_hash, payload, meta)
        parent = "" if meta.parent is None else _hex(meta.parent)
        reply = self._run("put", _hex(block_hash), record, parent, str(self._capacity))
        if reply is _FAILED:
            return False
        stored, fresh, evicted = int(reply[0]), int(reply[1]), [int(h, 16) for h in reply[2:]]
        self.stats.evictions += len(evicted)
        if evicted and self.events is not None:
            self.events.removed(self.name, evicted)
        if not stored:
            self.stats.rejected += 1
            return False
        if fresh:
            self.stats.puts += 1
            self.stats.bytes_in += len(payload)
            if self.events is not None:
                self.events.stored(self.name, meta.parent, [block_hash])
        self.stats.put_seconds += time.perf_counter() - start
        return True

    def get(self, block_hash: int) -> tuple[bytes, BlockMeta] | None:
        start = time.perf_counter()
        record = self._run("get", _hex(block_hash))
        if record is _FAILED or record is None:
            self.stats.misses += 1
            return None
        try:
            found = decode_record(block_hash, record)
        except CorruptBlock as exc:
            log.warning("shared tier: block %#x does not verify (%s); deleting it", block_hash, exc)
            self.stats.corrupt += 1
            self.stats.misses += 1
            self.delete(block_hash)
            return None
        self.stats.hits += 1
        self.stats.bytes_out += len(found[0])
        self.stats.get_seconds += time.perf_counter() - start
        return found

    def contains(self, block_hash: int) -> bool:
        return self.contains_many([block_hash])[0]

    def contains_many(self, hashes: Sequence[int]) -> list[bool]:
        if not hashes:
            return []

        def exists_all() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.exists(self._blob_prefix + _hex(block_hash))
            return pipe.execute()
        replies = self._call(exists_all)
        if replies is _FAILED:
            return [False] * len(hashes)
        return [bool(r) for r in replies]

    def delete(self, block_hash: int) -> bool:
        reply = self._run("del", _hex(block_hash))
        removed = reply is not _FAILED and int(reply) == 1
        if removed and self.events is not None:
            self.events.removed(self.name, [block_hash])
        return removed

    def pin(self, hashes: Iterable[int]) -> bool:
        reply = self._run("pin", str(self.max_pinned), *(_hex(h) for h in hashes))
        return reply is not _FAILED and int(reply) == 1

    def unpin(self, hashes: Iterable[int]) -> None:
        members = [_hex(h) for h in hashes]
        if members:
            self._call(lambda: self._client.srem(self._keys[4], *members))

    def hashes(self) -> list[int]:
        members = self._call(lambda: self._client.zrange(self._keys[0], 0, -1))
        return [] if members is _FAILED else [int(m, 16) for m in members]

    def clear(self) -> None:
        """Remove every key of this namespace (tests, admin resets)."""
        def scan_delete() -> None:
            for key in self._client.scan_iter(match=f"{self.namespace}:*", count=1000):
                self._client.delete(key)
        self._call(scan_delete)

    def close(self) -> None:
        self._client.close()

    def _run(self, op: str, *args: str | bytes) -> Any:
        return self._call(lambda: self._script(keys=self._keys, args=[op, self._blob_prefix, *args]))

    def _call(self, fn: Callable[[], T]) -> T | Any:
        """Run one Redis call; `_FAILED` (and a backoff) instead of an exception when Redis fails."""
        now = time.monotonic()
        if now < self._down_until:
            self.stats.errors += 1
            return _FAILED
        try:
            result = fn()
        except redis.RedisError as exc:
            self.stats.errors += 1
            self._down_until = now + self._backoff_s
            log.warning("shared tier: Redis call failed (%s); retrying in %.1fs", exc, self._backoff_s)
            self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
            return _FAILED
        if self._backoff_s != self._retry_after_s:
            log.info("shared tier: Redis is reachable again")
            self._backoff_s = self._retry_after_s
        return result
