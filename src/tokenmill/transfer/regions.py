"""An agent's registered regions, and what it knows of a peer's (from the peer's metadata)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.transfer.descriptors import Descriptor, validate_descriptors
from tokenmill.transfer.memory import REGION_KINDS, MemoryRegion

BYTE_KINDS = frozenset({"host", "shm"})  # kinds whose bytes this process can touch through a memoryview


class RegionTable:
    """Regions registered with one agent, by name."""

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self._regions: dict[str, MemoryRegion] = {}

    def register(self, region: MemoryRegion) -> None:
        if region.name in self._regions:
            raise ValueError(f"agent {self.agent!r} already has a region named {region.name!r}")
        self._regions[region.name] = region

    def deregister(self, name: str) -> MemoryRegion:
        if name not in self._regions:
            raise ValueError(f"agent {self.agent!r} has no region named {name!r}")
        return self._regions.pop(name)

    def __contains__(self, name: str) -> bool:
        return name in self._regions

    def get(self, name: str) -> MemoryRegion:
        return self._regions[name]

    def lengths(self) -> dict[str, int]:
        return {name: region.length for name, region in self._regions.items()}

    def kinds(self, names: Iterable[str]) -> set[str]:
        return {self._regions[name].kind for name in names}

    def describe(self) -> dict[str, dict[str, Any]]:
        return {name: region.describe() for name, region in self._regions.items()}

    def validate(self, descs: Sequence[Descriptor]) -> None:
        validate_descriptors(descs, self.lengths(), self.agent)

    def views(self, descs: Sequence[Descriptor]) -> list[memoryview]:
        """Byte views for (already validated) descriptors of host/shm regions."""
        out = []
        for d in descs:
            buffer = self._regions[d.region].buffer
            out.append(buffer[d.offset:d.offset + d.length])
        return out


@dataclass(slots=True)
class PeerInfo:
    """A remote agent as its metadata describes it."""

    name: str
    regions: dict[str, dict[str, Any]]  # name -> {"kind", "length", "shm_name"}
    backends: dict[str, dict[str, Any]]  # backend name -> its connection info

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> PeerInfo:
        try:
            name, regions, backends = metadata["name"], metadata["regions"], metadata["backends"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"agent metadata lacks {exc}; expected name, regions, backends") from exc
        if not isinstance(name, str) or not isinstance(regions, dict) or not isinstance(backends, dict):
            raise ValueError("agent metadata: name must be a str, regions and backends maps")
        for region, info in regions.items():
            if not isinstance(info, dict) or info.get("kind") not in REGION_KINDS or int(info.get("length", -1)) < 0:
                raise ValueError(f"agent {name!r} metadata: region {region!r} is malformed: {info!r}")
        return cls(name, dict(regions), dict(backends))

    def lengths(self) -> dict[str, int]:
        return {name: int(info["length"]) for name, info in self.regions.items()}

    def kinds(self, names: Iterable[str]) -> set[str]:
        return {self.regions[name]["kind"] for name in names}

    def validate(self, descs: Sequence[Descriptor]) -> None:
        validate_descriptors(descs, self.lengths(), self.name)
