"""The simulated connector: the planner driving the fleet simulator under its virtual clock.

Every interval the simulator calls `SimulatedDeployment.tick`: it builds the interval's
`Observation` from the simulator's records (arrivals counted as admitted demand, with their
prompts' spread and the busiest second's prompt tokens, as the live frontend exports; latencies of
the requests that got their first token, or finished, in the interval; the streams decoding at
each second, as the frontend samples them; queue and KV from the replicas), hands it to the planner, and applies the decision's actions as fleet changes
(started replicas serve after the fleet's start-up delay; removed ones drain). The planner
code is the one a live deployment runs. A request that arrives to a serving pool scaled to zero
waits in the simulator's backlog and wakes the planner's cold-start path at once (`wake`), as the
live frontend does; it is served after a replica's start-up.

With `fast_s`, the simulator calls `tick` every `fast_s` instead, and between intervals the
planner's fast path sees the last `fast_s` seconds (`observe_now`): the arrivals, and for TTFT the
first tokens that came in them beside the age of every request still waiting (a lower bound of
its TTFT, so a queue that is not moving shows at once).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tokenmill.planner.decision import Decision
from tokenmill.planner.observation import DRAINING, SERVING, STARTING, Observation, squared_cv
from tokenmill.planner.planner import Planner
from tokenmill.sim.fleet.config import FleetChange
from tokenmill.sim.fleet.fleet import FleetSim
from tokenmill.sim.fleet.records import RequestRecord

_STATES = {"up": SERVING, "starting": STARTING, "draining": DRAINING}


class Arrival(Protocol):
    arrival_s: float
    input_tokens: int
    output_tokens: int


def observe_arrivals(obs: Observation, arrived: Sequence[Arrival]) -> Observation:
    """`obs` with the demand of `arrived`: the count, mean lengths, the prompts' spread and the
    busiest second's prompt tokens (what the live frontend's counters give)."""
    obs.requests = len(arrived)
    if arrived:
        isl = np.array([r.input_tokens for r in arrived], dtype=np.float64)
        obs.mean_isl = float(isl.mean())
        obs.mean_osl = float(np.mean([r.output_tokens for r in arrived]))
        obs.isl_cv2 = squared_cv(len(isl), float(isl.sum()), float((isl * isl).sum()))
        seconds = np.floor([r.arrival_s for r in arrived]).astype(np.int64)
        obs.peak_prompt_tokens_per_s = float(np.bincount(seconds - seconds.min(), weights=isl).max())
    return obs


@dataclass(slots=True)
class SimulatedDeployment:
    planner: Planner
    interval_s: float
    warmup_s: float = 60.0  # a replica's latency counts for the correction once it served this long
    fast_s: float | None = None  # the fast path's period between intervals (None: no fast path)
    decisions: list[Decision] = field(default_factory=list)
    _next_interval_s: float | None = None
    _arrived: int = 0
    _completed: int = 0
    _waiting: list[RequestRecord] = field(default_factory=list)  # arrived, no first token yet
    _streaming: list[RequestRecord] = field(default_factory=list)  # a first token, not finished, at the last tick

    @property
    def tick_s(self) -> float:
        """How often the simulator must call `tick`."""
        return self.fast_s or self.interval_s

    def tick(self, sim: FleetSim) -> None:
        if self._next_interval_s is None:
            self._next_interval_s = self.interval_s
        if sim.now + 1e-9 >= self._next_interval_s:
            self._next_interval_s += self.interval_s
            decision: Decision | None = self.planner.step(self.observe(sim))
        else:
            decision = self.planner.fast_step(self.observe_now(sim))
        if decision is not None:
            self._apply(sim, decision)
        self.wake(sim)

    def wake(self, sim: FleetSim) -> None:
        """The planner's cold-start path, on the requests waiting for a serving pool with no replica."""
        obs = Observation(at_s=sim.now, interval_s=self.tick_s)
        self._replicas(obs, sim)
        decision = self.planner.cold_step(obs)
        if decision is not None:
            self._apply(sim, decision)

    def _apply(self, sim: FleetSim, decision: Decision) -> None:
        self.decisions.append(decision)
        for action in decision.actions:
            if action.delta > 0:
                sim.apply(FleetChange(sim.now, "add", action.role, action.delta))
            else:
                sim.apply(FleetChange(sim.now, "remove", action.role, -action.delta))

    def observe(self, sim: FleetSim) -> Observation:
        arrived = sim.arrived[self._arrived:]
        completed = sim.completed[self._completed:]
        self._arrived, self._completed = len(sim.arrived), len(sim.completed)
        waiting = self._waiting + arrived
        started = [r for r in waiting if r.first_token_s is not None]
        self._waiting = [r for r in waiting if r.first_token_s is None and not r.rejected]
        obs = observe_arrivals(Observation(at_s=sim.now, interval_s=self.interval_s), arrived)
        self._latencies(obs, started, completed)
        self._streams(obs, self._streaming + started, sim.now)
        self._replicas(obs, sim)
        return obs

    def observe_now(self, sim: FleetSim) -> Observation:
        """The last `fast_s` seconds, leaving the interval's own counts where they are."""
        window = self.fast_s or self.interval_s
        since = sim.now - window
        recent = []
        for record in reversed(sim.arrived):  # in arrival order: the window's are at the end
            if record.arrival_s < since:
                break
            recent.append(record)
        obs = observe_arrivals(Observation(at_s=sim.now, interval_s=window), recent)
        pending = self._waiting + sim.arrived[self._arrived:]
        waits = [sim.now - r.arrival_s for r in pending if r.first_token_s is None and not r.rejected]
        ttft = [r.ttft_s for r in pending if r.first_token_s is not None and r.first_token_s >= since]
        if waits or ttft:
            obs.ttft_p90_s = float(np.percentile(waits + ttft, 90))
        if waits:
            obs.queue_time_s = float(np.mean(waits))
        self._replicas(obs, sim)
        return obs

    def _streams(self, obs: Observation, candidates: list[RequestRecord], now: float) -> None:
        """The streams decoding (a first token, not finished) at each whole second of the
        interval, as the live frontend samples them: their mean and 90th percentile."""
        seconds = np.arange(math.floor(now - self.interval_s) + 1, math.floor(now) + 1, dtype=np.float64)
        self._streaming = [r for r in candidates if not r.finished and not r.rejected]
        if not len(seconds):
            return
        firsts = np.sort([r.first_token_s for r in candidates])
        ends = np.sort([r.last_token_s if r.finished else math.inf for r in candidates])
        counts = np.searchsorted(firsts, seconds, "right") - np.searchsorted(ends, seconds, "right")
        obs.streams_mean, obs.streams_p90 = float(counts.mean()), float(np.percentile(counts, 90))

    def _latencies(self, obs: Observation, started: list[RequestRecord], completed: list[RequestRecord]) -> None:
        ttft = [r.ttft_s for r in started if r.ttft_s is not None]
        if ttft:
            obs.ttft_p50_s, obs.ttft_p90_s = (float(v) for v in np.percentile(ttft, [50, 90]))
            prompt = sum(r.input_tokens for r in started)
            obs.hit_fraction = sum(r.cached_tokens for r in started) / prompt if prompt else 0.0
        itl = [r.itl_mean_s for r in completed if r.itl_mean_s is not None]
        if itl:
            obs.itl_p50_s, obs.itl_p90_s = (float(v) for v in np.percentile(itl, [50, 90]))

    def _replicas(self, obs: Observation, sim: FleetSim) -> None:
        states: dict[str, Counter[str]] = {}
        warm: Counter[str] = Counter()
        kv: list[float] = []
        waiting = len(sim.backlog)
        for replica in sim.replicas.values():
            state = _STATES.get(replica.state)
            if state is None:
                continue
            states.setdefault(replica.role, Counter())[state] += 1
            waiting += len(replica.worker.waiting)
            if state == SERVING and replica.up_s is not None and sim.now - replica.up_s >= self.warmup_s:
                warm[replica.role] += 1
            if state == SERVING and replica.role == sim.serving_role:
                kv.append(replica.worker.kv.usage())
        obs.replicas = {role: dict(counts) for role, counts in states.items()}
        obs.warm_replicas = dict(warm)
        obs.queue_depth = waiting
        obs.waiting_for_worker = len(sim.backlog)
        obs.decode_kv_usage = float(np.mean(kv)) if kv else None
