"""The planner's step: observation → forecast → proposal → limits → actions, as one `Decision`.

    decision = planner.step(obs)        # every interval: the forecast path (or scale-down)
    decision = planner.fast_step(obs)   # between intervals, over a short window: None unless a
                                        # pool's first tokens are late now and replicas were added
    decision = planner.cold_step(obs)   # at any moment: None unless requests wait for a serving
                                        # pool scaled to zero, which then gets its first replica

The same object runs against a live deployment (a connector reads `/metrics` and
`/admin/workers`) and inside the fleet simulator (`planner/simulated.py`); it never touches
either itself. Invariants: a pool with missing metrics is held, not planned on zeros; an
interval with no arrivals is zero traffic (the pools go to their minimums, after the
sustained-low rule); replicas counted as present are the serving and starting ones, so a
replica that never became healthy is not counted (its connector reports it failed). The
serving pool, where its minimum is 0, is wanted at 0 while the deployment is idle (no arrivals,
nothing in flight), and the constrainer lets it go there once the idleness has lasted
(`Limits.zero_after_intervals`).
"""
from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from tokenmill.planner.constrain import Constrainer
from tokenmill.planner.decision import Action, Decision
from tokenmill.planner.headroom import ForecastErrors
from tokenmill.planner.observation import SERVING, STARTING, Observation
from tokenmill.planner.propose import Proposal, Proposer

log = logging.getLogger(__name__)

COLD_RETRY_S = 30.0  # a cold start whose replica is gone again (failed) is tried again after this long


class Forecaster(Protocol):
    def observe(self, requests: float, isl: float | None, osl: float | None) -> None: ...

    def predict(self): ...  # -> an object with requests, isl, osl


class Planner:
    def __init__(self, forecaster: Forecaster, proposer: Proposer, constrainer: Constrainer,
                 keep: int = 500, lookahead_intervals: float = 0.0, forecast_quantile: float | None = None) -> None:
        self.forecaster = forecaster
        self.errors = ForecastErrors(forecast_quantile)
        # a replica asked for now serves only after its start-up: size for the load then, carrying a
        # rising forecast's step on that far (never a falling one: removals have their own rule). A
        # step is carried only as far as both the forecast's distance from this interval's count and
        # its own rise over the last forecast show it: on an on/off load every quiet interval is far
        # below a smoothed forecast that is not rising at all.
        self.lookahead = max(lookahead_intervals, 0.0)
        self.proposer = proposer
        self.constrainer = constrainer
        self.decisions: deque[Decision] = deque(maxlen=keep)
        self._last_isl: float | None = None
        self._last_osl: float | None = None
        self._last_forecast: float | None = None
        self._idle_for = 0  # intervals in a row with no request arriving, waiting or streaming
        self._cold_started_at: float | None = None  # the last cold start, until latency is the pool's again
        self._cold_serving_at: float | None = None  # ... when its replica was first seen serving
        self._interval_s = 0.0  # the planning interval, as the last `step` saw it

    @property
    def mode(self) -> str:
        return self.proposer.mode

    @property
    def may_scale_to_zero(self) -> bool:
        """The serving pool (agg, or decode) may have no replica: requests then wait for one."""
        return self.constrainer.limits.minimum(self.proposer.roles[-1]) == 0

    def step(self, obs: Observation) -> Decision:
        self._interval_s = obs.interval_s
        current = {role: obs.count(role) for role in self.proposer.roles}
        decision = Decision(obs.at_s, self.mode, obs, current)
        held = self._missing(obs)
        if held:
            decision.held, decision.path = held, "held"
            decision.target = dict(current)
        else:
            self._plan(obs, decision)
            if decision.actions and all(a.delta < 0 for a in decision.actions):
                decision.path = "scale-down"
        decision.reason = decision.explain()
        self.decisions.append(decision)
        log.debug("planner at %.0f s: %s", obs.at_s, decision.reason)
        return decision

    def fast_step(self, obs: Observation) -> Decision | None:
        """Between intervals, `obs` over a short window: a prefill (or aggregated) pool whose first
        tokens are late now (TTFT p90 over the target, or queue time over half of it), with no
        replica already starting, gets at once what the window's arrivals need by the performance
        model, and at least one more, within the limits. Only adds: removals keep the interval's
        sustained-low rule. None when no pool is late (or the limits leave nothing to add)."""
        if self._held_through_cold_start(obs):
            return None
        late = {role: why for role, why in _late_first_tokens(self, obs).items() if not obs.count(role, STARTING)}
        isl, osl = obs.mean_isl or self._last_isl, obs.mean_osl or self._last_osl or 1.0
        if not late or obs.requests is None or isl is None:  # no prompt length seen yet: nothing to size by
            return None
        current = {role: obs.count(role) for role in self.proposer.roles}
        decision = Decision(obs.at_s, self.mode, obs, current, path="fast")
        window = _Load(float(obs.requests), isl, osl)
        proposal = self.proposer.predictive(window, obs)
        wanted = {role: max(proposal.replicas[role], current[role] + 1) if role in late else current[role]
                  for role in current}
        constrained = self.constrainer.grow(wanted, current)
        decision.proposed, decision.target = wanted, constrained.replicas
        decision.proposal_reasons = [f"{role}: {why} now" for role, why in late.items()] + proposal.reasons
        decision.constraints, decision.inputs = constrained.notes, proposal.inputs
        decision.actions = [Action(role, n - current[role]) for role, n in sorted(constrained.replicas.items())
                            if n > current[role]]
        if not decision.actions:
            return None
        decision.reason = decision.explain()
        self.decisions.append(decision)
        log.debug("planner fast path at %.0f s: %s", obs.at_s, decision.reason)
        return decision

    def cold_step(self, obs: Observation) -> Decision | None:
        """Requests wait at the frontend and the serving pool (agg, or decode) has no replica,
        serving or starting: start its minimum (at least one) at once, within the limits; the
        next interval's plan sizes it. None otherwise."""
        role = self.proposer.roles[-1]
        waiting = obs.waiting_for_worker or 0
        if not waiting or obs.count(role):
            return None
        if self._cold_started_at is not None and obs.at_s - self._cold_started_at < COLD_RETRY_S:
            return None  # the last one was started moments ago and is gone already: no start loop
        current = {r: obs.count(r) for r in self.proposer.roles}
        wanted = current | {role: max(self.constrainer.limits.minimum(role), 1)}
        constrained = self.constrainer.grow(wanted, current)
        decision = Decision(obs.at_s, self.mode, obs, current, path="cold-start", proposed=wanted,
                            target=constrained.replicas, constraints=constrained.notes)
        decision.proposal_reasons = [f"{role}: {waiting} request(s) waiting and no {role} replica (scaled to zero)"]
        decision.actions = [Action(r, n - current[r]) for r, n in sorted(constrained.replicas.items()) if n > current[r]]
        if not decision.actions:
            return None
        self._idle_for = 0
        self._cold_started_at, self._cold_serving_at = obs.at_s, None
        decision.reason = decision.explain()
        self.decisions.append(decision)
        log.info("planner cold start at %.0f s: %s", obs.at_s, decision.reason)
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
        previous, self._last_forecast = self._last_forecast, forecast.requests
        rise = max(min(forecast.requests - float(obs.requests or 0),
                       forecast.requests - (previous if previous is not None else forecast.requests)), 0.0)
        # requests still queued are demand the next interval must serve too, beside the new ones
        backlog = float(obs.queue_depth or 0)
        margin = self.errors.margin()
        ahead = _Load(forecast.requests + rise * self.lookahead + backlog + margin, forecast.isl, forecast.osl,
                      forecast.peak_prompt_tokens_per_s)
        decision.forecast = {"requests": forecast.requests, "isl": forecast.isl, "osl": forecast.osl,
                             "requests_at_horizon": ahead.requests, "backlog": backlog, "error_margin": margin}
        seen = obs
        if self._held_through_cold_start(obs):  # their first tokens timed the start-up, not the pool
            seen = dataclasses.replace(obs, ttft_p50_s=None, ttft_p90_s=None, queue_time_s=None)
        proposal = self.proposer.propose(ahead, seen)
        if seen is not obs:
            proposal.reasons.append(f"{self.proposer.roles[0]}: TTFT not used: requests waited through a cold start")
        self._idle_for = self._idle_for + 1 if _idle(obs) else 0
        if self._idle_for:
            self._want_zero(proposal)
        if backlog:
            proposal.reasons.append(f"{self.proposer.roles[0]}: {backlog:.0f} requests queued, counted as demand")
        if margin:
            proposal.reasons.append(f"{self.proposer.roles[0]}: +{margin:.0f} requests for the forecast's recent "
                                    f"errors (their {self.errors.quantile:.0%} quantile)")
        constrained = self.constrainer.apply(proposal.replicas, decision.current, _need(proposal),
                                             _over_target_of(self, seen), {self.proposer.roles[-1]: self._idle_for})
        decision.proposed = dict(proposal.replicas)
        decision.target = constrained.replicas
        decision.proposal_reasons = proposal.reasons
        decision.constraints = constrained.notes
        decision.inputs = proposal.inputs
        decision.expected_ttft_s, decision.expected_itl_s = proposal.expected_ttft_s, proposal.expected_itl_s
        decision.actions = [Action(role, n - decision.current.get(role, 0))
                            for role, n in sorted(constrained.replicas.items()) if n != decision.current.get(role, 0)]

    def _want_zero(self, proposal: Proposal) -> None:
        """Idle: the serving pool, if its minimum is 0, wants none (the constrainer waits for it to
        last). A prefill pool needs no idleness for 0: the decode pool then prefills itself."""
        role = self.proposer.roles[-1]
        if self.constrainer.limits.minimum(role) == 0:
            proposal.replicas[role] = 0
            proposal.reasons.insert(0, f"{role}: idle for {self._idle_for} interval(s), minimum 0: 0 wanted")

    def _held_through_cold_start(self, obs: Observation) -> bool:
        """Whether `obs`'s latency may still be that of the requests held through the last cold
        start (their TTFT is the start-up's, and the backlog they make drains after it): from the
        cold start until a window that began a planning interval after its replica was seen serving."""
        if self._cold_started_at is None:
            return False
        if self._cold_serving_at is None:
            if obs.count(self.proposer.roles[-1], SERVING):
                self._cold_serving_at = obs.at_s
            return True
        if obs.at_s - obs.interval_s < self._cold_serving_at + self._interval_s:
            return True
        self._cold_started_at = self._cold_serving_at = None
        return False


def _idle(obs: Observation) -> bool:
    """No request arrived in the interval, none waits, none streams."""
    return not (obs.requests or obs.waiting_for_worker or obs.queue_depth or obs.streams_p90 or obs.streams_mean)


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


def _late_first_tokens(planner: "Planner", obs: Observation) -> dict[str, str]:
    """The pool that makes first tokens (prefill, or the aggregated one), if they are late in `obs`."""
    ttft, _ = planner.proposer.targets()
    role = planner.proposer.roles[0]
    if obs.ttft_p90_s is not None and obs.ttft_p90_s > ttft:
        return {role: f"TTFT p90 {obs.ttft_p90_s * 1e3:.0f} ms > {ttft * 1e3:.0f} ms"}
    if obs.queue_time_s is not None and obs.queue_time_s > ttft / 2:
        return {role: f"queue time {obs.queue_time_s * 1e3:.0f} ms > half the TTFT target"}
    return {}


def _need(proposal: Proposal) -> dict[str, float]:
    """Each pool's load in replicas' worth, for the survivors rule (the proposal's count when the
    mode gives no fractional figure)."""
    inputs = proposal.inputs
    need = {"prefill": inputs.get("prefill_need"), "decode": inputs.get("decode_need"), "agg": inputs.get("need")}
    return {role: float(need[role] if need.get(role) is not None else n) for role, n in proposal.replicas.items()}
