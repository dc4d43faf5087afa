"""Failures a decode worker can inject into its own KV pulls (`--transfer-faults`), so the
recompute paths are exercised by tests and drills against real transfers."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TransferFaults:
    """Failures to inject into this worker's KV pulls (testing and drills only)."""

    corrupt: bool = False  # flip a byte of the pulled KV before it is verified
    drop: bool = False  # drop the connection to the prefill worker as soon as a read starts
    delay_s: float = 0.0  # wait this long before pulling (a window to kill the prefill worker)

    @classmethod
    def parse(cls, spec: str | None) -> TransferFaults:
        """`corrupt,drop,delay=0.5` (any subset); ValueError naming the bad item."""
        faults = cls()
        for item in filter(None, (part.strip() for part in (spec or "").split(","))):
            name, _, value = item.partition("=")
            if name in ("corrupt", "drop") and not value:
                setattr(faults, name, True)
            elif name == "delay" and value:
                try:
                    faults.delay_s = float(value)
                except ValueError:
                    raise ValueError(f"--transfer-faults: delay needs seconds, got {value!r}") from None
            else:
                raise ValueError(f"--transfer-faults: unknown fault {item!r} (corrupt, drop, delay=S)")
        return faults
