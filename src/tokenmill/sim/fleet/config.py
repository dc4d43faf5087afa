"""What a fleet simulation is asked to run: the deployment, its changes over time, the SLA.

Plain typed data, validated on construction (a ValueError names the field, as a CLI flag).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE
from tokenmill.router.disagg import DisaggConfig
from tokenmill.router.policies import check_policy
from tokenmill.sim.fleet.clock import Profile
from tokenmill.tenants.config import Tenant

ROLES = ("agg", "prefill", "decode")
ACTIONS = ("add", "remove", "rerole")


@dataclass(slots=True, frozen=True)
class FleetChange:
    """At `at_s`, add `count` replicas of `role`, remove (drain) them, or re-role them to `to_role`.

    An added replica serves only after the fleet's `replica_startup_s`; a removed one takes no
    new requests and finishes what it holds; a re-roled one drains, then starts in its new role.
    """

    at_s: float
    action: str
    role: str
    count: int = 1
    to_role: str | None = None

    def __post_init__(self) -> None:
        if not self.at_s >= 0 or self.at_s == float("inf"):
            raise ValueError(f"fleet change: field at_s must be a time >= 0, got {self.at_s}")
        if self.action not in ACTIONS:
            raise ValueError(f"fleet change: field action must be one of {ACTIONS}, got {self.action!r}")
        if self.role not in ROLES or (self.action == "rerole" and self.to_role not in ROLES):
            raise ValueError(f"fleet change: fields role/to_role must be one of {ROLES}")
        if self.count < 1:
            raise ValueError(f"fleet change: field count must be >= 1, got {self.count}")
        if self.to_role is not None and self.action != "rerole":
            raise ValueError(f"fleet change: field to_role only goes with action rerole, not {self.action!r}")


@dataclass(slots=True, frozen=True)
class SLA:
    ttft_s: float
    itl_s: float

    def __post_init__(self) -> None:
        if not self.ttft_s > 0:
            raise ValueError(f"--ttft-ms must be > 0, got {self.ttft_s * 1e3:g}")
        if not self.itl_s > 0:
            raise ValueError(f"--itl-ms must be > 0, got {self.itl_s * 1e3:g}")


@dataclass(slots=True, frozen=True)
class FleetConfig:
    """A deployment: `agg` aggregated replicas, or `prefill` + `decode` pools (any may start at 0
    when `changes` add replicas later). One profile per role (model, GPU, precision, layout)."""

    profiles: dict[str, Profile]
    agg: int = 0
    prefill: int = 0
    decode: int = 0
    router: str = "kv"
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_blocks: int | None = None  # per replica; default: what the profile's memory holds
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    replica_startup_s: float = 60.0
    changes: tuple[FleetChange, ...] = ()
    sla: SLA = field(default_factory=lambda: SLA(2.0, 0.05))
    usd_per_gpu_hour: float = 3.0
    power_cap_kw: float | None = None
    interval_s: float = 60.0
    seed: int = 0
    tenants: tuple[Tenant, ...] = ()  # the requests' tenants: their class sets the engine's priority
    max_in_flight: int | None = None  # the frontend's slots, released by class and fair share
    batch_share: float = 0.8  # the share of those slots batch-class requests may hold

    def __post_init__(self) -> None:
        for name in ("agg", "prefill", "decode"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.agg and (self.prefill or self.decode):
            raise ValueError("--agg: give either --agg N or --prefill P --decode D, not both")
        roles = set(self.roles_used())
        if "agg" in roles and roles != {"agg"}:
            raise ValueError("--change: an aggregated fleet cannot gain prefill or decode replicas (nor the reverse)")
        if roles and "agg" not in roles and "decode" not in roles:
            raise ValueError("--decode: a disaggregated fleet needs decode replicas (now or by a --change)")
        if not (self.agg or self.decode or any(c.action == "add" for c in self.changes)):
            raise ValueError("--agg: the fleet has no replica to serve with")
        check_policy(self.router)
        for role in self.roles_used():
            if role not in self.profiles:
                raise ValueError(f"--{'layout' if role == 'agg' else role + '-layout'}: no profile for role {role!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError(f"--kv-blocks must be >= 1, got {self.kv_blocks}")
        if self.replica_startup_s < 0 or self.interval_s <= 0 or self.usd_per_gpu_hour < 0:
            raise ValueError("--replica-startup-s and --usd-per-gpu-hour must be >= 0, --interval-s > 0")
        if self.power_cap_kw is not None and self.power_cap_kw <= 0:
            raise ValueError(f"--power-cap-kw must be > 0, got {self.power_cap_kw}")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.decode) or any(
            "prefill" in (c.role, c.to_role) for c in self.changes)

    def roles_used(self) -> list[str]:
        roles = {r for r in ROLES if getattr(self, r)}
        for change in self.changes:
            roles.add(change.role)
            if change.to_role:
                roles.add(change.to_role)
        return sorted(roles)
