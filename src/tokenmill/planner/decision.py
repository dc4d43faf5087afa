"""Typed records of what the planner did and why: the answer to "why did it (not) scale?".

A `Decision` carries what was observed, the forecast, the proposal and the numbers behind it,
every limit that changed it, the actions taken, which path acted (`path`), and one line in words
that leads with the cause ("decode: KV 91% > 85%; +1 decode").

Paths: `forecast` (the interval's plan added replicas or kept the fleet), `scale-down` (the
interval's plan removed some, after its sustained-low rule), `fast` (between intervals, a pool's
first tokens were late now and replicas were added at once), `cold-start` (requests waited for a
serving pool scaled to zero, which got its first replica at once), `held` (metrics were missing).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.planner.observation import Observation


@dataclass(slots=True, frozen=True)
class Action:
    role: str
    delta: int  # > 0: start this many; < 0: drain this many

    def describe(self) -> str:
        return f"{self.delta:+d} {self.role}"


@dataclass(slots=True)
class Decision:
    at_s: float
    mode: str
    observed: Observation
    current: dict[str, int]  # serving + starting, per role
    forecast: dict[str, float] | None = None  # requests (per interval), isl, osl
    proposed: dict[str, int] = field(default_factory=dict)
    target: dict[str, int] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    proposal_reasons: list[str] = field(default_factory=list)
    constraints: list[str] = field(default_factory=list)
    inputs: dict[str, Any] = field(default_factory=dict)
    expected_ttft_s: float | None = None
    expected_itl_s: float | None = None
    reason: str = ""
    held: str | None = None  # why nothing was planned (missing metrics), if so
    path: str = "forecast"  # forecast | scale-down | fast | cold-start | held: which path decided

    def explain(self) -> str:
        """The one-line reason: per changed pool the cause, else why it held."""
        if self.held:
            return self.held
        parts = []
        for action in self.actions:
            causes = [_first(self.proposal_reasons, action.role)]
            causes += [c for c in self.constraints if c.startswith(action.role + ":")]
            parts.append("; ".join([c for c in causes if c] + [action.describe()]))
        if parts:
            prefix = {"fast": "fast path: ", "cold-start": "cold start: "}.get(self.path, "")
            return prefix + " | ".join(parts)
        limits = [c for c in self.constraints if "holding" in c or "keeping" in c]
        if limits:
            return "no change: " + "; ".join(limits)
        return "no change: the fleet matches the forecast (" + ", ".join(
            f"{n} {role}" for role, n in sorted(self.target.items())) + ")"

    def to_json(self) -> dict[str, Any]:
        return {"at_s": self.at_s, "mode": self.mode, "reason": self.reason, "current": self.current,
                "forecast": self.forecast, "proposed": self.proposed, "target": self.target,
                "actions": [{"role": a.role, "delta": a.delta} for a in self.actions],
                "proposal_reasons": self.proposal_reasons, "constraints": self.constraints,
                "expected_ttft_s": self.expected_ttft_s, "expected_itl_s": self.expected_itl_s,
                "inputs": self.inputs, "observed": self.observed.to_json(), "held": self.held, "path": self.path}


def _first(lines: list[str], role: str) -> str | None:
    return next((line for line in lines if line.startswith(role + ":")), None)
