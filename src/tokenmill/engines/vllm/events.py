"""vLLM's KV events, re-published as tokenmill's (`kv.events`) with tokenmill's block hashes.

vLLM's engine core publishes `KVEventBatch`es on a ZeroMQ PUB socket as (topic, seq, payload)
frames. Each `BlockStored` carries its blocks' token ids, so the tokenmill chain is recomputed
here with `kv.hashing` (the one definition):

    tm[first]  = block_hashes(tokens[0:B], seed, extra_key=salt)[0]        (no parent)
    tm[i]      = block_hashes(tokens[i*B:(i+1)*B], seed, parent=tm[i-1])   (parent = vLLM's parent,
                                                                            mapped to its tm hash)
and `vllm hash -> tm hash` is kept per tier until the block is removed, so a `BlockRemoved` (which
carries only vLLM's hashes) removes the right tokenmill hashes. vLLM's `medium` names the tier:
GPU (vLLM's device cache, on CPU hosts too) -> device, CPU -> host, STORAGE -> disk.

A gap in vLLM's sequence numbers (a slow start, a full queue) is filled from vLLM's replay socket;
batches that are gone from its buffer are reported and the worker's own view is then what
snapshots serve. The view (tier -> tm hashes held) answers the routers' snapshot requests.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.asyncio

from tokenmill.kv.events import KVEventEmitter
from tokenmill.kv.hashing import block_hashes

log = logging.getLogger(__name__)

MEDIUM_TIERS = {None: "device", "GPU": "device", "CPU": "host", "STORAGE": "disk", "DISK": "disk"}
END_SEQ = -1
REPLAY_TIMEOUT_MS = 2000


class VLLMEventBridge:
    def __init__(self, emitter: KVEventEmitter, block_size: int, hash_seed: int = 0) -> None:
        self.emitter = emitter
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._decode: Any = None  # vLLM's batch decoder, made on start (vLLM is only imported there)
        self._tm_of: dict[str, dict[Any, int]] = {}  # tier -> vLLM hash -> tokenmill hash
        self._last_seq = -1
        self.unchained = 0  # stored blocks whose parent was never seen (their chain cannot be rebuilt)
        self.lost_batches = 0  # batches neither received nor replayable
        self._task: asyncio.Task | None = None

    def start(self, publish: str, replay: str, topic: str) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self._task = asyncio.create_task(self._run(publish, replay, topic))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def view(self) -> dict[str, list[int]]:
        """Every tokenmill hash held now, per tier (a snapshot; consistent with the last event id
        because events are applied on the loop thread this is read from)."""
        return {tier: list(hashes.values()) for tier, hashes in self._tm_of.items() if hashes}

    async def _run(self, publish: str, replay: str, topic: str) -> None:
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sub.connect(publish)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    log.warning("vLLM KV events: dropping a frame of %d parts", len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq > self._last_seq + 1:
                    await self._replay(ctx, replay, self._last_seq + 1, seq)
                if seq > self._last_seq:
                    self._apply_payload(seq, frames[2])
        finally:
            sub.close()

    async def _replay(self, ctx: zmq.asyncio.Context, endpoint: str, first: int, upto: int) -> None:
        """Fetch batches first..upto-1 from vLLM's replay socket and apply them in order."""
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        try:
            await dealer.send_multipart([b"", first.to_bytes(8, "big")])
            while await dealer.poll(REPLAY_TIMEOUT_MS):
                _, _, seq_bytes, payload = await dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ or seq >= upto:
                    break
                if seq > self._last_seq:
                    self._apply_payload(seq, payload)
        finally:
            dealer.close()
        if self._last_seq < upto - 1:
            self.lost_batches += upto - 1 - self._last_seq
            log.warning("vLLM KV events: batches %d..%d lost (not replayable)", self._last_seq + 1, upto - 1)
            self._last_seq = upto - 1

    def _apply_payload(self, seq: int, payload: bytes) -> None:
        self._last_seq = seq
        try:
            batch = self._decode(payload)
        except ValueError as exc:  # msgspec's DecodeError is one
            log.warning("vLLM KV events: undecodable batch %d: %s", seq, exc)
            return
        self.apply(batch.events)

    def apply(self, events: Iterable[Any]) -> None:
        """Re-publish vLLM events (BlockStored, BlockRemoved, AllBlocksCleared) as tokenmill's."""
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                self._removed(event)
            elif kind == "AllBlocksCleared":
                self._tm_of.clear()
                self.emitter.cleared()

    def _stored(self, event: Any) -> None:
        tier = MEDIUM_TIERS.get(event.medium, "device")
        mapping = self._tm_of.setdefault(tier, {})
        parent = None
        if event.parent_block_hash is not None:
            parent = self._known(event.parent_block_hash)
            if parent is None:
                self.unchained += len(event.block_hashes)
                log.warning("vLLM KV events: %d blocks stored after a parent never seen", len(event.block_hashes))
                return
        salt = _cache_salt(event) if parent is None else None
        size = event.block_size or self.block_size
        hashes = block_hashes(event.token_ids[:size * len(event.block_hashes)], size, self.hash_seed,
                              extra_key=salt, parent=parent)
        for vllm_hash, tm_hash in zip(event.block_hashes, hashes):
            mapping[vllm_hash] = tm_hash
        self.emitter.stored(tier, parent, hashes)

    def _removed(self, event: Any) -> None:
        tier = MEDIUM_TIERS.get(event.medium, "device")
        mapping = self._tm_of.get(tier, {})
        hashes = [h for h in (mapping.pop(v, None) for v in event.block_hashes) if h is not None]
        self.emitter.removed(tier, hashes)

    def _known(self, vllm_hash: Any) -> int | None:
        """A parent's tokenmill hash, from whichever tier stored it (a host-tier block may continue a
        device chain)."""
        for mapping in self._tm_of.values():
            if vllm_hash in mapping:
                return mapping[vllm_hash]
        return None


def _cache_salt(event: Any) -> str | None:
    """The first block's cache salt (vLLM lists it among the block's extra keys): tokenmill folds the
    same string into block 0's seed."""
    keys = (event.extra_keys or [None])[0] or ()
    salts = [k for k in keys if isinstance(k, str)]
    return salts[-1] if salts else None
