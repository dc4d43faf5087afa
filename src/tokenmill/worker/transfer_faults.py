"""Failures a decode worker can inject into its own KV pulls (`--transfer-faults`), so the
recompute paths are exercised by tests and drills against real transfers.

A worker numbers its pulls from 1 as they start; `corrupt=N` hits pulls N, 2N, 3N, ... and a bare
`corrupt` every pull (N = 1), so a drill can leave most pulls intact and still know which fail.
"""
from __future__ import annotations

from dataclasses import dataclass

PERIODIC = ("corrupt", "drop")


@dataclass(slots=True)
class TransferFaults:
    """Failures to inject into this worker's KV pulls (testing and drills only)."""

    corrupt_every: int = 0  # flip a byte of every N-th pull's KV before it is verified (0: never)
    drop_every: int = 0  # drop every N-th pull's connection as soon as its read starts (0: never)
    delay_s: float = 0.0  # wait this long before pulling (a window to kill the prefill worker)

    def corrupts(self, pull: int) -> bool:
        """Whether this worker's `pull`-th pull (from 1) is corrupted."""
        return _hits(self.corrupt_every, pull)

    def drops(self, pull: int) -> bool:
        """Whether this worker's `pull`-th pull (from 1) has its connection dropped."""
        return _hits(self.drop_every, pull)

    @classmethod
    def parse(cls, spec: str | None) -> TransferFaults:
        """`corrupt,drop=3,delay=0.5` (any subset); ValueError naming the bad item."""
        faults = cls()
        for item in filter(None, (part.strip() for part in (spec or "").split(","))):
            name, _, value = item.partition("=")
            if name in PERIODIC:
                setattr(faults, f"{name}_every", _period(name, value))
            elif name == "delay" and value:
                try:
                    faults.delay_s = float(value)
                except ValueError:
                    raise ValueError(f"--transfer-faults: delay needs seconds, got {value!r}") from None
            else:
                raise ValueError(f"--transfer-faults: unknown fault {item!r} (corrupt[=N], drop[=N], delay=S)")
        return faults


def _hits(every: int, pull: int) -> bool:
    return every > 0 and pull % every == 0


def _period(name: str, value: str) -> int:
    if not value:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--transfer-faults: {name}=N needs a whole number of pulls >= 1, got {value!r}")
    return int(value)
