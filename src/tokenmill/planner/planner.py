"""The planner's step: observation → forecast → proposal → limits → actions, as one `Decision`.

The same object runs against a live deployment (a connector reads `/metrics` and
`/admin/workers`) and inside the fleet simulator (`planner/simulated.py`); it never touches
either itself. Invariants: a pool with missing metrics is held, not planned on zeros; an
interval with no arrivals is zero traffic (the pools go to their minimums, after the
sustained-low rule); replicas counted as present are the serving and starting ones, so a
replica that never became healthy is not counted (its connector reports it failed).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from tokenmill.planner.constrain import Constrainer
from tokenmill.planner.decision import Action, Decision
from tokenmill.planner.headroom import ForecastErrors
from tokenmill.planner.observation import Observation
from tokenmill.planner.propose import Proposal, Proposer

log = logging.getLogger(__name__)


class Forecaster(Protocol):
    def observe(self, requests: float, isl: float | None, osl: float | None) -> None: ...

    def predict(self): ...  # -> an object with requests, isl, osl


class Planner:
    def __init__(self, forecaster: Forecaster, proposer: Proposer, constrainer: Constrainer,
                 keep: int = 500, lookahead_intervals: float = 0.0, forecast_quantile: float | None = None) -> None:
        self.forecaster = forecaster
        self.errors = ForecastErrors(forecast_quantile)
        # a replica asked for now serves only after its start-up: size for the load then, carrying a
        # rising forecast's step on that far (never a falling one: removals have their own rule)
        self.lookahead = max(lookahead_intervals, 0.0)
        self.proposer = proposer
        self.constrainer = constrainer
        self.decisions: deque[Decision] = deque(maxlen=keep)
        self._last_isl: float | None = None
        self._last_osl: float | None = None

    @property
    def mode(self) -> str:
        return self.proposer.mode

    def step(self, obs: Observation) -> Decision:
        current = {role: obs.count(role) for role in self.proposer.roles}
        decision = Decision(obs.at_s, self.mode, obs, current)
        held = self._missing(obs)
        if held:
            decision.held = held
            decision.target = dict(current)
        else:
            self._plan(obs, decision)
        decision.reason = decision.explain()
        self.decisions.append(decision)
        log.debug("planner at %.0f s: %s", obs.at_s, decision.reason)
        return decision

    def _missing(self, obs: Observation) -> str | None:
        if obs.requests is None:
            return "holding: the request count is missing from this interval's metrics"
        if obs.requests > 0 and obs.mean_isl is None and self._last_isl is None:
            return "holding: requests arrived but their prompt lengths are missing"
        return None

    def _plan(self, obs: Observation, decision: Decision) -> None:
        isl = obs.mean_isl if obs.mean_isl is not None else self._last_isl
        osl = obs.mean_osl if obs.mean_osl is not None else self._last_osl
        self._last_isl, self._last_osl = isl, osl
        self.forecaster.observe(float(obs.requests or 0), isl if obs.requests else None,
                                osl if obs.requests else None)
        forecast = self.forecaster.predict()
        self.errors.record(float(obs.requests or 0))
        self.errors.expect(forecast.requests)
        rise = max(forecast.requests - float(obs.requests or 0), 0.0)
        # requests still queued are demand the next interval must serve too, beside the new ones
        backlog = float(obs.queue_depth or 0)
        margin = self.errors.margin()
        ahead = _Load(forecast.requests + rise * self.lookahead + backlog + margin, forecast.isl, forecast.osl,
                      forecast.peak_prompt_tokens_per_s)
        decision.forecast = {"requests": forecast.requests, "isl": forecast.isl, "osl": forecast.osl,
                             "requests_at_horizon": ahead.requests, "backlog": backlog, "error_margin": margin}
        proposal = self.proposer.propose(ahead, obs)
        if backlog:
            proposal.reasons.append(f"{self.proposer.roles[0]}: {backlog:.0f} requests queued, counted as demand")
        if margin:
            proposal.reasons.append(f"{self.proposer.roles[0]}: +{margin:.0f} requests for the forecast's recent "
                                    f"errors (their {self.errors.quantile:.0%} quantile)")
        constrained = self.constrainer.apply(proposal.replicas, decision.current, _need(proposal),
                                             _over_target_of(self, obs))
        decision.proposed = dict(proposal.replicas)
        decision.target = constrained.replicas
        decision.proposal_reasons = proposal.reasons
        decision.constraints = constrained.notes
        decision.inputs = proposal.inputs
        decision.expected_ttft_s, decision.expected_itl_s = proposal.expected_ttft_s, proposal.expected_itl_s
        decision.actions = [Action(role, n - decision.current.get(role, 0))
                            for role, n in sorted(constrained.replicas.items()) if n != decision.current.get(role, 0)]


@dataclass(slots=True, frozen=True)
class _Load:
    requests: float
    isl: float
    osl: float
    peak_prompt_tokens_per_s: float | None = None


def _over_target_of(planner: "Planner", obs: Observation) -> dict[str, str]:
    """Pools whose latency is over its target this interval: none of their replicas may go."""
    ttft, itl = planner.proposer.targets()
    out = {}
    for role in planner.proposer.roles:
        if role in ("prefill", "agg") and obs.ttft_p90_s is not None and obs.ttft_p90_s > ttft:
            out[role] = f"TTFT p90 {obs.ttft_p90_s * 1e3:.0f} ms > {ttft * 1e3:.0f} ms"
        elif role in ("decode", "agg") and obs.itl_p90_s is not None and obs.itl_p90_s > itl:
            out[role] = f"ITL p90 {obs.itl_p90_s * 1e3:.1f} ms > {itl * 1e3:.1f} ms"
    return out


def _need(proposal: Proposal) -> dict[str, float]:
    """Each pool's load in replicas' worth, for the survivors rule (the proposal's count when the
    mode gives no fractional figure)."""
    inputs = proposal.inputs
    need = {"prefill": inputs.get("prefill_need"), "decode": inputs.get("decode_need"), "agg": inputs.get("need")}
    return {role: float(need[role] if need.get(role) is not None else n) for role, n in proposal.replicas.items()}
