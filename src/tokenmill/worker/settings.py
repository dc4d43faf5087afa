"""What one worker process is told: its identity, where it binds and what it advertises to
other hosts, its role and its limits. Validated here, so a bad flag fails before the engine loads.
"""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("agg", "prefill", "decode")


@dataclass(slots=True)
class WorkerSettings:
    worker_id: str
    address: str  # ipc:// or tcp:// to bind
    model_name: str
    role: str = "agg"
    max_queue: int | None = None  # requests allowed to wait beyond a full running batch
    parent_pid: int | None = None  # exit when this process (the supervisor) is gone
    events_address: str | None = None  # where KV events are published (None: not published)
    drain_timeout_s: float = 10.0  # on stop: how long prefill-only work and held KV may finish
    advertise_host: str | None = None  # what other hosts dial (bind 0.0.0.0, advertise this host's IP)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.advertise_host is not None:
            if not self.advertise_host or any(c in self.advertise_host for c in "/: "):
                raise ValueError(f"--advertise-host: a host name or IP address, got {self.advertise_host!r}")
            for flag, address in (("--address", self.address), ("--events-address", self.events_address)):
                if address is not None and not address.startswith("tcp://"):
                    raise ValueError(f"--advertise-host needs a tcp:// {flag} (other hosts cannot dial {address})")


def advertised(address: str, host: str | None) -> str:
    """A bound tcp:// address as other hosts must dial it: `host` in place of the bound one."""
    if host is None:
        return address
    return f"tcp://{host}:{address.rsplit(':', 1)[1]}"
