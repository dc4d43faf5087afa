"""The self-verifying byte record a block is stored as on disk, in a shared directory and in Redis.

Layout (little-endian):

    magic "TMKB" | version u8 | 3 pad | meta_len u32 | payload_len u64 |
    block_hash u64 | payload_xxh3 u64 | meta_xxh3 u64 | meta (msgpack) | payload

The payload checksum is the contract (xxh3_64 of the payload); the meta checksum
and the block hash in the header catch a damaged header or a record filed under
the wrong key. Lengths are checked against the record size, so a torn write
(a truncated file) never decodes. Metadata is msgpack; nothing is pickled.
"""
from __future__ import annotations

import struct

import msgpack
import xxhash

from tokenmill.kv.tiers.base import BlockMeta

MAGIC = b"TMKB"
VERSION = 1
HEADER = struct.Struct("<4sB3xIQQQQ")
_MASK64 = (1 << 64) - 1


class CorruptBlock(Exception):
    """A stored record that does not verify; callers count it and treat it as a miss."""


def checksum(payload: bytes | memoryview) -> int:
    """The payload checksum every stored block carries."""
    return xxhash.xxh3_64_intdigest(payload)


def encode_meta(meta: BlockMeta) -> bytes:
    return msgpack.packb({"p": meta.parent, "t": list(meta.token_ids)})


def decode_meta(raw: bytes | memoryview) -> BlockMeta:
    try:
        obj = msgpack.unpackb(raw)
        parent = obj["p"]
        return BlockMeta(None if parent is None else int(parent), tuple(int(t) for t in obj["t"]))
    except (ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise CorruptBlock(f"undecodable block meta: {exc}") from exc


def encode_record(block_hash: int, payload: bytes, meta: BlockMeta) -> bytes:
    meta_raw = encode_meta(meta)
    header = HEADER.pack(MAGIC, VERSION, len(meta_raw), len(payload), block_hash & _MASK64,
                         checksum(payload), checksum(meta_raw))
    return b"".join((header, meta_raw, payload))


def record_size(payload_len: int, meta: BlockMeta) -> int:
    """Bytes `encode_record` would produce (what a byte-backed tier charges against capacity)."""
    return HEADER.size + len(encode_meta(meta)) + payload_len


def decode_record(block_hash: int, record: bytes | memoryview) -> tuple[bytes, BlockMeta]:
    """Payload and meta of a record stored under `block_hash`; CorruptBlock if anything is off."""
    view = memoryview(record)
    if len(view) < HEADER.size:
        raise CorruptBlock(f"record of {len(view)} bytes is shorter than its header")
    magic, version, meta_len, payload_len, stored_hash, payload_sum, meta_sum = HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"bad magic/version {magic!r}/{version}")
    if stored_hash != block_hash & _MASK64:
        raise CorruptBlock(f"record holds block {stored_hash:#x}, expected {block_hash:#x}")
    if HEADER.size + meta_len + payload_len != len(view):
        raise CorruptBlock("record length does not match its header (torn write?)")
    meta_raw = view[HEADER.size:HEADER.size + meta_len]
    payload = view[HEADER.size + meta_len:]
    if checksum(meta_raw) != meta_sum:
        raise CorruptBlock("meta checksum mismatch")
    if checksum(payload) != payload_sum:
        raise CorruptBlock("payload checksum mismatch")
    return bytes(payload), decode_meta(meta_raw)
