"""Routing policies and the `Router` the frontend holds (one per worker pool).

    router = Router(RouterConfig(policy="kv"))           # --router {kv,kv-approx,round-robin,random,least-loaded}
    router.add_worker("w0"); router.add_worker("w1")    # from discovery, at any time
    decision = router.select(RoutingRequest(request_id, block_hashes(prompt), len(prompt)))
    ...send to decision.worker...
    router.on_first_token(request_id); router.on_finished(request_id)   # finished also on abort/error
    router.on_progress(request_id, num_tokens, num_cached_tokens)       # each delta: the decode charge
    router.apply_event(event)            # every KV event from the subscription; on ApplyStatus.GAP
                                         # ask event.worker for a snapshot, then router.apply_snapshot(...)
    router.report_load(worker, prefill_blocks, decode_blocks)          # other frontends' load there
    router.report_capacity(worker, num_blocks)                         # its device pool size
    router.remove_worker("w1")           # lease lost: index, load and approx entries dropped

`select` charges the chosen worker's load (and, in kv and kv-approx mode, records the prompt's
blocks against it). Policies: `kv` scores every candidate with `tokenmill.router.cost`
on the event-built `KVIndexer` — or, while the events are stale (none for
`events_stale_after_s` across routing decisions: the event plane is down), on the
`ApproxIndexer` its own decisions keep, and says so (`kv-approx` in the decision and its
counter); `kv-approx` always scores on `ApproxIndexer`;
`round-robin` and `random` ignore state; `least-loaded` samples two candidates and takes
the one with fewer active blocks (power of two choices). In disaggregated deployments
hold two routers: the prefill pool's on `kv`, the decode pool's on the configured policy
(`kv` by default in `tokenmill serve`: the overlap it reports is what conditional
disaggregation compares with its threshold).
KV events from workers not added (or already removed) are IGNORED: a worker that joins
late starts with a gap and is rebuilt from its snapshot.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tokenmill.kv.events import KVEvent
from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE
from tokenmill.router.approx import ApproxIndexer
from tokenmill.router.cost import CostConfig, choose, worker_terms
from tokenmill.router.decision import RoutingDecision, RoutingRequest
from tokenmill.router.indexer import ApplyStatus, KVIndexer, WorkerMatches
from tokenmill.router.load import LoadTracker
from tokenmill.router.stats import RouterStats

log = logging.getLogger(__name__)

POLICIES: tuple[str, ...] = ("kv", "kv-approx", "round-robin", "random", "least-loaded")
_NO_OVERLAP: dict[str, int] = {}


def check_policy(policy: str) -> None:
    """ValueError naming `--router` unless `policy` is one of `POLICIES`."""
    if policy not in POLICIES:
        raise ValueError(f"--router must be one of {', '.join(POLICIES)}, got {policy!r}")


class NoWorkerAvailable(LookupError):
    """No worker to route to (none registered, or none of the candidates)."""


@dataclass(slots=True)
class RouterConfig:
    policy: str = "kv"
    block_size: int = DEFAULT_BLOCK_SIZE
    cost: CostConfig = field(default_factory=CostConfig)
    approx_ttl_s: float = 120.0
    approx_max_blocks: int = 1_000_000
    events_stale_after_s: float = 30.0

    def __post_init__(self) -> None:
        check_policy(self.policy)
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.events_stale_after_s <= 0:
            raise ValueError(f"--events-stale-after-s must be positive, got {self.events_stale_after_s}")


class Router:
    def __init__(self, config: RouterConfig | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.config = config or RouterConfig()
        self.policy = self.config.policy
        self._tier_weights = dict(self.config.cost.tier_weights)  # as configured, for use_tiers(True)
        self.rng = rng or random.Random()
        self.timer = timer
        self.load = LoadTracker(self.config.block_size)
        self.indexer = KVIndexer(self.config.cost.tier_preference()) if self.policy == "kv" else None
        self.approx = (ApproxIndexer(self.config.approx_ttl_s, self.config.approx_max_blocks, clock)
                       if self.policy in ("kv", "kv-approx") else None)
        events_counter = (lambda: self.indexer.events_applied) if self.indexer is not None else None  # type: ignore[union-attr]
        self.stats = RouterStats(events_counter, self.config.events_stale_after_s, clock=clock)
        self._workers: dict[str, None] = {}  # insertion-ordered set
        self._turn = 0

    # ---- membership ---------------------------------------------------------------------

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._workers)

    def add_worker(self, worker: str) -> None:
        self._workers[worker] = None
        self.load.add_worker(worker)

    def remove_worker(self, worker: str) -> None:
        self._workers.pop(worker, None)
        self.load.remove_worker(worker)
        if self.indexer is not None:
            self.indexer.remove_worker(worker)
        if self.approx is not None:
            self.approx.remove_worker(worker)

    # ---- decisions ----------------------------------------------------------------------

    def select(self, request: RoutingRequest, candidates: Sequence[str] | None = None) -> RoutingDecision:
        """Pick a worker among `candidates` (default: all) and charge it the request."""
        started = self.timer()
        pool = self._candidates(candidates)
        prompt_blocks = request.prompt_blocks(self.config.block_size)
        if self.policy == "kv" and self.indexer is not None or self.policy == "kv-approx" and self.approx is not None:
            approximate = self.policy == "kv-approx" or self.stats.events_stale()
            decision = self._select_by_cost(request, pool, prompt_blocks, approximate)
        else:
            worker, reason = self._select_by_rule(pool)
            decision = RoutingDecision(request.request_id, worker, self.policy, reason, prompt_blocks,
                                       prefill_charge=prompt_blocks, decode_charge=prompt_blocks)
        self.load.on_routed(request.request_id, decision.worker, decision.prefill_charge, decision.decode_charge,
                            request.block_hashes, prompt_blocks)
        if self.approx is not None:
            self.approx.record(decision.worker, request.block_hashes)
        self.stats.observe_decision(decision.policy, self.timer() - started, decision.overlap_blocks)
        self.stats.events_stale()  # raises the alarm (a warning) even when nobody scrapes
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", decision.explain())
        return decision

    def set_policy(self, policy: str) -> None:
        """Route the next requests by `policy`. `kv` and `kv-approx` need the index this router was
        built with; every policy keeps feeding it, so switching back routes on a current index."""
        check_policy(policy)
        if policy == "kv" and self.indexer is None or policy == "kv-approx" and self.approx is None:
            raise ValueError(f"this router was built for {self.config.policy}: {policy} needs an index it lacks")
        self.policy = policy

    def use_tiers(self, enabled: bool) -> None:
        """Count the blocks workers hold in KV tiers below their device pools, or (tiers turned off
        on the workers: nothing is loaded from them) only their device blocks."""
        weights = dict(self._tier_weights)
        if not enabled:
            weights = {tier: weight if tier == "device" else 0.0 for tier, weight in weights.items()}
        self.config.cost = dataclasses.replace(self.config.cost, tier_weights=weights)

    def on_first_token(self, request_id: str) -> None:
        self.load.on_first_token(request_id)

    def on_progress(self, request_id: str, num_tokens: int, num_cached_tokens: int) -> None:
        self.load.on_progress(request_id, num_tokens, num_cached_tokens)

    def on_finished(self, request_id: str) -> None:
        self.load.on_finished(request_id)

    def worker_of(self, request_id: str) -> str | None:
        """The worker a request in flight was routed to (None once it finished, or never routed)."""
        return self.load.worker_of(request_id)

    def report_capacity(self, worker: str, num_blocks: int | None) -> None:
        """The worker's device KV pool in blocks: a request that would not fit there costs more."""
        self.load.set_capacity(worker, num_blocks)

    def report_load(self, worker: str, prefill_blocks: float, decode_blocks: float) -> None:
        """What the worker holds for requests this router did not route (see `router.load`)."""
        self.load.set_external(worker, prefill_blocks, decode_blocks)

    # ---- KV events ----------------------------------------------------------------------

    def apply_event(self, event: KVEvent) -> ApplyStatus:
        if self.indexer is None or event.worker not in self._workers:
            return ApplyStatus.IGNORED
        return self.indexer.apply(event)

    def apply_snapshot(self, worker: str, tier_hashes: Mapping[str, Iterable[int]],
                       last_event_id: int) -> ApplyStatus:
        if self.indexer is None or worker not in self._workers:
            return ApplyStatus.IGNORED
        return self.indexer.apply_snapshot(worker, tier_hashes, last_event_id)

    def metrics_snapshot(self) -> dict[str, float]:
        index = self.indexer
        index_blocks = (index.num_blocks() if index is not None
                        else self.approx.num_blocks() if self.approx is not None else 0)
        snap = self.stats.metrics_snapshot(
            index_blocks, index.events_applied if index else 0, index.gaps_detected if index else 0,
            index.gaps_recovered if index else 0, self.workers)
        for worker in self.workers:
            load = self.load.load(worker)
            snap[f'tokenmill_router_worker_load_blocks{{worker="{worker}",kind="prefill"}}'] = load.prefill_blocks
            snap[f'tokenmill_router_worker_load_blocks{{worker="{worker}",kind="decode"}}'] = load.decode_blocks
        return snap

    # ---- internals ----------------------------------------------------------------------

    def _candidates(self, candidates: Sequence[str] | None) -> Sequence[str]:
        if candidates is None:
            pool: Sequence[str] = self.workers
        else:
            unknown = [w for w in candidates if w not in self._workers]
            if unknown:
                raise ValueError(f"candidates not registered with the router: {unknown}")
            pool = candidates
        if not pool:
            raise NoWorkerAvailable("no worker to route to")
        return pool

    def _select_by_cost(self, request: RoutingRequest, pool: Sequence[str], prompt_blocks: int,
                        approximate: bool) -> RoutingDecision:
        index = self.approx if approximate else self.indexer
        matches: WorkerMatches = index.match(request.block_hashes)  # type: ignore[union-attr]
        cost, load = self.config.cost, self.load.load
        hashes, short = request.block_hashes, self.load.shortfall
        terms = [worker_terms(w, prompt_blocks, matches.get(w, _NO_OVERLAP), load(w), cost,
                              short(w, hashes, prompt_blocks)) for w in pool]
        chosen_index, reason, probability = choose(terms, cost.temperature, self.rng)
        chosen = terms[chosen_index]
        return RoutingDecision(
            request.request_id, chosen.worker, "kv-approx" if approximate else "kv", reason, prompt_blocks,
            overlap_blocks=sum(n for tier, n in chosen.overlap.items() if cost.tier_weights[tier] > 0),
            prefill_charge=chosen.new_prefill,
            decode_charge=chosen.request_decode, probability=probability, terms=terms)

    def _select_by_rule(self, pool: Sequence[str]) -> tuple[str, str]:
        if self.policy == "round-robin":
            worker = pool[self._turn % len(pool)]
            self._turn += 1
            return worker, "round-robin: next in turn"
        if self.policy == "random" or len(pool) == 1:
            return self.rng.choice(pool), f"{self.policy}: uniform among {len(pool)} workers"
        first, second = self.rng.sample(list(pool), 2)
        first_load = self.load.load(first).active_blocks
        second_load = self.load.load(second).active_blocks
        worker = first if first_load <= second_load else second
        return worker, (f"power of two choices: {first} ({first_load:g} active blocks) "
                        f"vs {second} ({second_load:g})")
