"""From the replicas a proposal wants to the replicas the planner asks for: the limits.

In order: per-pool min/max; scale-down only after the proposal has stayed below the current
count for `scale_down_intervals` in a row, and only as far as the survivors can absorb the
removed replicas' load (each left at most `scale_down_utilisation` of its capacity, so 2 ↔ 1
does not oscillate); at most ±`max_step` replicas per pool per interval; then the GPU and power
budgets, trimmed from the pool with the most to spare. Every limit that changes a number leaves
a line saying which and by how much.

Scale to zero: the serving pool (agg, or decode), where its minimum is 0, goes to 0 only once the
deployment has been idle (no request arriving, none in flight) for `zero_after_intervals` in a
row; until then it keeps at least one replica and the rules above apply to the rest. (A prefill
pool with minimum 0 goes to 0 by the rules above: the decode pool then prefills itself.)
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class Limits:
    min_replicas: Mapping[str, int] = field(default_factory=dict)  # role -> at least (default 1)
    max_replicas: Mapping[str, int] = field(default_factory=dict)  # role -> at most (default none)
    gpu_budget: int | None = None  # GPUs across every pool
    power_kw: float | None = None  # kW across every pool
    max_step: int = 2  # replicas added or removed per pool per interval
    scale_down_intervals: int = 3  # consecutive proposals below current before removing any
    scale_down_utilisation: float = 0.8  # the survivors' share of capacity after a removal, at most
    zero_after_intervals: int = 10  # idle intervals in a row before a pool with minimum 0 goes to 0

    def __post_init__(self) -> None:
        if self.max_step < 1:
            raise ValueError(f"--max-step must be >= 1, got {self.max_step}")
        if self.scale_down_intervals < 1:
            raise ValueError(f"--scale-down-intervals must be >= 1, got {self.scale_down_intervals}")
        if not 0 < self.scale_down_utilisation <= 1:
            raise ValueError(f"--scale-down-utilisation must be in (0, 1], got {self.scale_down_utilisation}")
        if self.zero_after_intervals < 1:
            raise ValueError(f"--scale-to-zero-after-s must span at least one interval, got {self.zero_after_intervals}")
        for role, low in self.min_replicas.items():
            high = self.max_replicas.get(role)
            if low < 0 or (high is not None and high < low):
                raise ValueError(f"--min-{role}/--max-{role}: need 0 <= min <= max, got {low}..{high}")
        if self.gpu_budget is not None and self.gpu_budget < 1:
            raise ValueError(f"--gpu-budget must be >= 1, got {self.gpu_budget}")
        if self.power_kw is not None and self.power_kw <= 0:
            raise ValueError(f"--power-kw must be > 0, got {self.power_kw}")

    def minimum(self, role: str) -> int:
        return self.min_replicas.get(role, 1)


@dataclass(slots=True)
class Constrained:
    replicas: dict[str, int]
    notes: list[str]


class Constrainer:
    """Applies `Limits`; remembers how long each pool has wanted fewer replicas."""

    def __init__(self, limits: Limits, gpus_per_replica: Mapping[str, int], watts_per_gpu: float = 700.0) -> None:
        self.limits = limits
        self.gpus = dict(gpus_per_replica)
        self.watts_per_gpu = watts_per_gpu
        self.below_for: dict[str, int] = {}

    def apply(self, wanted: Mapping[str, int], current: Mapping[str, int],
              need: Mapping[str, float], over_target: Mapping[str, str] | None = None,
              idle_for: Mapping[str, int] | None = None) -> Constrained:
        """`need`: each pool's load in replicas' worth (fractional), for the survivors rule;
        `over_target`: pools whose latency is over its target now (why), which lose no replica;
        `idle_for`: the pools that go to zero only when idle (the serving one), and how many
        intervals in a row the deployment has been; the others go to zero by the usual rules."""
        notes: list[str] = []
        out = {role: self._bounds(role, n, notes) for role, n in wanted.items()}
        for role, n in out.items():
            why = (over_target or {}).get(role)
            if why and n < current.get(role, 0):
                notes.append(f"{role}: {n} wanted, keeping {current[role]}: {why}")
                self.below_for[role] = 0
                out[role] = current[role]
                continue
            if n == 0 and current.get(role, 0) > 0 and idle_for is not None and role in idle_for:
                kept = self._to_zero(role, current[role], idle_for[role], need.get(role, 0.0), notes)
                out[role] = self._step(role, kept, current[role], notes)
                continue
            out[role] = self._scale_down(role, n, current.get(role, 0), need.get(role, 0.0), notes)
            out[role] = self._step(role, out[role], current.get(role, 0), notes)
        self._budgets(out, current, notes)
        return Constrained(out, notes)

    def grow(self, wanted: Mapping[str, int], current: Mapping[str, int]) -> Constrained:
        """Additions only (the fast path): bounds, step and budgets, and no pool's count of
        intervals wanting fewer is touched, so the sustained-low rule runs on undisturbed."""
        notes: list[str] = []
        out = {role: max(self._bounds(role, n, notes), current.get(role, 0)) for role, n in wanted.items()}
        out = {role: self._step(role, n, current.get(role, 0), notes) for role, n in out.items()}
        self._budgets(out, current, notes)
        return Constrained(out, notes)

    def _bounds(self, role: str, n: int, notes: list[str]) -> int:
        low, high = self.limits.minimum(role), self.limits.max_replicas.get(role)
        if n < low:
            notes.append(f"{role}: minimum {low} (wanted {n})")
            return low
        if high is not None and n > high:
            notes.append(f"{role}: maximum {high} (wanted {n})")
            return high
        return n

    def _scale_down(self, role: str, n: int, current: int, need: float, notes: list[str]) -> int:
        if n >= current:
            self.below_for[role] = 0
            return n
        self.below_for[role] = self.below_for.get(role, 0) + 1
        wait = self.limits.scale_down_intervals
        if self.below_for[role] < wait:
            notes.append(f"{role}: {n} wanted, holding {current} until {wait} intervals agree "
                         f"({self.below_for[role]} so far)")
            return current
        absorbable = max(math.ceil(need / self.limits.scale_down_utilisation - 1e-9), self.limits.minimum(role))
        kept = min(max(absorbable, n), current)
        if kept > n:
            notes.append(f"{role}: {n} would leave each survivor over {self.limits.scale_down_utilisation:.0%} "
                         f"of its capacity ({need:.2f} replicas of load); keeping {kept}")
        if kept < current:
            self.below_for[role] = 0  # a removal restarts the wait for the next one
        return kept

    def _to_zero(self, role: str, current: int, idle_for: int, need: float, notes: list[str]) -> int:
        """0 once idle long enough (the idle wait stands for the sustained-low rule), else at
        least one replica, the others under the usual rules."""
        wait = self.limits.zero_after_intervals
        if idle_for >= wait:
            notes.append(f"{role}: no request for {idle_for} intervals: scaled to zero")
            self.below_for[role] = 0
            return 0
        if current > 1:
            return self._scale_down(role, 1, current, need, notes)
        notes.append(f"{role}: 0 wanted, holding {current} until idle for {wait} intervals ({idle_for} so far)")
        return current

    def _step(self, role: str, n: int, current: int, notes: list[str]) -> int:
        k = self.limits.max_step
        if abs(n - current) <= k:
            return n
        limited = current + k if n > current else current - k
        notes.append(f"{role}: at most {k} per interval ({current} -> {limited}, wanted {n})")
        return limited

    def _budgets(self, out: dict[str, int], current: Mapping[str, int], notes: list[str]) -> None:
        caps = []
        if self.limits.gpu_budget is not None:
            caps.append((self.limits.gpu_budget, f"GPU budget {self.limits.gpu_budget}"))
        if self.limits.power_kw is not None:
            gpus = int(self.limits.power_kw * 1e3 // self.watts_per_gpu)
            caps.append((gpus, f"power budget {self.limits.power_kw:g} kW ({gpus} GPUs)"))
        for budget, name in caps:
            before = dict(out)
            while self._total_gpus(out) > budget:
                spare = [r for r in out if out[r] > self.limits.minimum(r)]
                if not spare:
                    notes.append(f"{name}: the pools' minimums alone exceed it")
                    break
                # trim the pool that grows most over what it has now (ties: the larger pool)
                role = max(spare, key=lambda r: (out[r] - current.get(r, 0), out[r]))
                out[role] -= 1
            notes += [f"{role}: {name} caps it at {out[role]} (wanted {before[role]})"
                      for role in out if out[role] != before[role]]

    def _total_gpus(self, replicas: Mapping[str, int]) -> int:
        return sum(n * self.gpus.get(role, 1) for role, n in replicas.items())
