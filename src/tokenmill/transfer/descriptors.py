"""Descriptor lists: which bytes of which region a transfer moves.

A `Descriptor(region, offset, length)` names `length` bytes at `offset` in a registered region.
A transfer pairs a source list with a destination list of the same shape: pair i moves
`src[i].length` bytes to `dst[i]` (lengths must match pairwise); the bytes move as one stream
in list order, so a checksum of the stream does not depend on how the lists are cut.

- `validate_descriptors` rejects unregistered regions and out-of-range bytes with a
  `ValueError` naming the agent, region, offset and length.
- `coalesce_pairs` merges neighbouring pairs that are adjacent on both sides, so a run of
  contiguous blocks moves as one copy (shm) or one send (tcp).
- `encode_descriptors`/`decode_descriptors` put a list on the wire compactly (msgpack-able:
  a region-name table and one little-endian int64 array), never pickled.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Descriptor:
    """`length` bytes at `offset` in the region registered as `region`."""

    region: str
    offset: int
    length: int


def total_bytes(descs: Sequence[Descriptor]) -> int:
    return sum(d.length for d in descs)


def validate_descriptors(descs: Sequence[Descriptor], region_lengths: Mapping[str, int], agent: str) -> None:
    """Raise `ValueError` unless every descriptor lies inside a region `agent` registered."""
    for i, d in enumerate(descs):
        length = region_lengths.get(d.region)
        if length is None:
            known = ", ".join(sorted(region_lengths)) or "none"
            raise ValueError(f"descriptor {i}: region {d.region!r} is not registered with agent {agent!r} "
                             f"(registered: {known})")
        if d.offset < 0 or d.length <= 0 or d.offset + d.length > length:
            raise ValueError(f"descriptor {i}: bytes [{d.offset}, {d.offset + d.length}) of region {d.region!r} "
                             f"of agent {agent!r} are out of range (region holds {length} bytes)")


def check_pairs(src: Sequence[Descriptor], dst: Sequence[Descriptor]) -> None:
    """Raise `ValueError` unless the two lists pair up one to one with equal lengths."""
    if len(src) != len(dst):
        raise ValueError(f"source has {len(src)} descriptors, destination {len(dst)}")
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.length != d.length:
            raise ValueError(f"pair {i}: source moves {s.length} bytes, destination holds {d.length}")


def coalesce_pairs(src: Sequence[Descriptor], dst: Sequence[Descriptor]) -> tuple[list[Descriptor], list[Descriptor]]:
    """Merge each pair into the previous one when both sides continue it byte for byte."""
    check_pairs(src, dst)
    out_src: list[Descriptor] = []
    out_dst: list[Descriptor] = []
    for s, d in zip(src, dst):
        if out_src:
            ps, pd = out_src[-1], out_dst[-1]
            if (s.region == ps.region and s.offset == ps.offset + ps.length
                    and d.region == pd.region and d.offset == pd.offset + pd.length):
                out_src[-1] = Descriptor(ps.region, ps.offset, ps.length + s.length)
                out_dst[-1] = Descriptor(pd.region, pd.offset, pd.length + d.length)
                continue
        out_src.append(s)
        out_dst.append(d)
    return out_src, out_dst


def coalesce(descs: Sequence[Descriptor]) -> list[Descriptor]:
    """Merge neighbours adjacent in the same region (one side only, e.g. for a checksum)."""
    return coalesce_pairs(descs, descs)[0]


def encode_descriptors(descs: Sequence[Descriptor]) -> dict[str, Any]:
    """A msgpack-able form: region names once, then (region index, offset, length) as int64 LE."""
    names: dict[str, int] = {}
    table = np.empty((len(descs), 3), dtype="<i8")
    for i, d in enumerate(descs):
        table[i] = (names.setdefault(d.region, len(names)), d.offset, d.length)
    return {"regions": list(names), "table": table.tobytes()}


def decode_descriptors(obj: Mapping[str, Any]) -> list[Descriptor]:
    """Inverse of `encode_descriptors`; malformed input raises `ValueError`."""
    try:
        names = [str(name) for name in obj["regions"]]
        raw = bytes(obj["table"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed descriptor list: {exc}") from exc
    if len(raw) % 24:
        raise ValueError(f"descriptor table of {len(raw)} bytes is not a whole number of entries")
    table = np.frombuffer(raw, dtype="<i8").reshape(-1, 3)
    if len(table) and (table[:, 0].min() < 0 or table[:, 0].max() >= len(names)):
        raise ValueError("descriptor table names a region index outside its region list")
    return [Descriptor(names[r], off, length) for r, off, length in table.tolist()]
