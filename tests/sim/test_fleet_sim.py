"""The fleet simulator against independent references: queueing theory, a brute-force LRU, itself."""
from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pytest

from tokenmill.datasets import MOONCAKE_TRACE, data_file
from tokenmill.router.disagg import DisaggConfig
from tokenmill.sim.fleet.arrivals import TraceRequest, load_trace
from tokenmill.sim.fleet.clock import StepClock, parse_profile
from tokenmill.sim.fleet.config import SLA, FleetChange, FleetConfig
from tokenmill.sim.fleet.fleet import FleetSim
from tokenmill.sim.fleet.report import run_fleet, summarize
from tokenmill.sim.fleet.synthetic import synthetic
from tokenmill.step_work import StepWork

PROFILE = parse_profile("llama-3.1-8b@h100:fp8:tp1")


class ConstantClock(StepClock):
    """Every step lasts `seconds_per_step`, whatever it computes (an M/D/1 server)."""

    def __init__(self, seconds_per_step: float) -> None:
        super().__init__(PROFILE)
        self.seconds_per_step = seconds_per_step

    def seconds(self, work: StepWork) -> float:
        return self.seconds_per_step


def _simulate(config: FleetConfig, requests: Sequence[TraceRequest], clocks=None) -> FleetSim:
    sim = FleetSim(config, clocks)
    sim.run(requests)
    return sim


def test_same_seed_same_trace_gives_identical_json() -> None:
    requests = load_trace(data_file(MOONCAKE_TRACE), max_requests=300, tokens_per_hash_block=64, rate_scale=1.5)
    config = FleetConfig(profiles={"prefill": PROFILE, "decode": PROFILE}, prefill=2, decode=2, kv_blocks=3000,
                         router="kv", interval_s=10.0, seed=7, changes=(FleetChange(30.0, "add", "decode"),))
    first = json.dumps(run_fleet(config, requests).to_json(), sort_keys=True)
    again = json.dumps(run_fleet(config, load_trace(data_file(MOONCAKE_TRACE), max_requests=300,
                                                    tokens_per_hash_block=64, rate_scale=1.5)).to_json(), sort_keys=True)
    assert first == again
    totals = json.loads(first)["totals"]
    assert totals["finished"] == totals["requests"] == len(requests) > 300


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_single_worker_poisson_arrivals_match_md1_queueing_delay(rho: float) -> None:
    """One request per step of D seconds, Poisson arrivals: TTFT = D + ρD / (2(1 − ρ)) (Pollaczek–Khinchine)."""
    service = 0.1
    requests = synthetic("poisson", rate=rho / service, num_requests=20_000, input_tokens=64, output_tokens=1, seed=3)
    config = FleetConfig(profiles={"agg": PROFILE}, agg=1, max_num_seqs=1, kv_blocks=1000, router="round-robin")
    sim = _simulate(config, requests, {"agg": ConstantClock(service)})
    ttft = np.array([r.ttft_s for r in sim.records.values()])
    expected = service + rho * service / (2 * (1 - rho))
    assert ttft.mean() == pytest.approx(expected, rel=0.05)
    assert ttft.min() == pytest.approx(service)  # nobody is served faster than one step


def _brute_force_lru_hits(requests: Sequence[TraceRequest], capacity: int, block_size: int) -> list[int]:
    """Cached prompt tokens per request, one request at a time, from a plain list as the free queue.

    Each request takes its leading cached blocks (never the last prompt position), then fresh
    blocks off the queue's front (dropping the hashes they held), registers its prompt blocks and
    puts every block back at the end, last block first.
    """
    queue: list[int | None] = [None] * capacity  # front = least recently freed; None = holds no hash
    hits_per_request = []
    for r in requests:
        hits = []
        for h in r.block_hashes[:(r.input_tokens - 1) // block_size]:
            if h not in queue:
                break
            hits.append(h)
        for h in hits:
            queue.remove(h)
        total_blocks = -(-(r.input_tokens + r.output_tokens - 1) // block_size)
        fresh = total_blocks - len(hits)
        del queue[:fresh]
        mine: list[int | None] = list(hits)
        for h in r.block_hashes[len(hits):]:
            mine.append(None if h in queue or h in mine else h)
        mine += [None] * (total_blocks - len(mine))
        queue.extend(reversed(mine))
        hits_per_request.append(len(hits) * block_size)
    return hits_per_request


def test_prefix_hits_on_a_mooncake_slice_equal_a_brute_force_lru() -> None:
    requests = load_trace(data_file(MOONCAKE_TRACE), max_requests=400, tokens_per_hash_block=32,
                          max_output_tokens=8, time_scale=100.0)  # 100x slower: one request at a time
    capacity, block_size = 600, 16
    config = FleetConfig(profiles={"agg": PROFILE}, agg=1, max_num_seqs=1, kv_blocks=capacity, block_size=block_size)
    sim = _simulate(config, requests)
    assert all(r.finished for r in sim.records.values())
    simulated = [sim.records[r.request_id].cached_tokens for r in requests]
    expected = _brute_force_lru_hits(requests, capacity, block_size)
    assert simulated == expected
    assert sum(expected) > 0 and sum(1 for e in expected if e) < len(expected)  # hits and misses both occur


def test_a_replica_added_serves_only_after_its_startup_and_a_removed_one_drains() -> None:
    requests = synthetic("poisson", rate=20.0, duration_s=60.0, input_tokens=256, output_tokens=64, seed=1)
    changes = (FleetChange(10.0, "add", "agg"), FleetChange(40.0, "remove", "agg"))
    config = FleetConfig(profiles={"agg": PROFILE}, agg=1, replica_startup_s=5.0, router="round-robin",
                         interval_s=1.0, changes=changes)
    sim = _simulate(config, requests)
    result = summarize(sim)
    added = sim.replicas["agg-1"]
    served_by_added = [r for r in sim.records.values() if r.worker == "agg-1"]
    assert served_by_added and min(r.arrival_s for r in served_by_added) >= 15.0
    assert max(r.arrival_s for r in served_by_added) <= 40.0
    assert all(r.finished for r in sim.records.values())  # draining lost nothing
    assert added.gone_s is not None and added.gone_s >= 40.0
    gpus = {i["start_s"]: i["gpus"] for i in result.intervals}
    assert gpus[5.0] == 1 and gpus[12.0] == 2 and gpus[50.0] == 1
    assert [c["applied"] for c in result.changes] == [1, 1]


def test_power_cap_refuses_replicas_beyond_it() -> None:
    requests = synthetic("poisson", rate=5.0, num_requests=50, input_tokens=128, output_tokens=8, seed=2)
    config = FleetConfig(profiles={"agg": PROFILE}, agg=1, power_cap_kw=1.5, changes=(FleetChange(1.0, "add", "agg", 3),))
    result = run_fleet(config, requests)
    assert result.changes[0]["applied"] == 1 and "power cap" in result.changes[0]["reason"]
    with pytest.raises(ValueError, match="--power-cap-kw"):
        run_fleet(FleetConfig(profiles={"agg": PROFILE}, agg=3, power_cap_kw=1.5), requests)


def test_disaggregated_fleet_prefills_long_prompts_remotely_and_moves_their_kv() -> None:
    requests = synthetic("poisson", rate=4.0, num_requests=200, input_tokens=2048, output_tokens=32,
                         input_sigma=0.8, seed=4)
    config = FleetConfig(profiles={"prefill": PROFILE, "decode": PROFILE}, prefill=1, decode=1,
                         sla=SLA(1.0, 0.05))
    sim = _simulate(config, requests)
    records = list(sim.records.values())
    remote = [r for r in records if r.prefill == "remote"]
    local = [r for r in records if r.prefill == "local"]
    assert remote and local and all(r.finished for r in records)
    assert all(r.input_tokens >= 256 for r in remote) and all(r.input_tokens < 256 for r in local)
    assert all(r.prefill_worker.startswith("prefill") for r in remote)
    # the KV crossed a link before the second token: never faster than the transfer itself
    clock = sim.clocks["prefill"]
    for r in remote[:20]:
        assert r.itl_max_s >= clock.transfer_seconds(r.input_tokens, True) * 0.999


@pytest.mark.parametrize("local_limit", [0, 1, 2])
def test_an_overloaded_prefill_pool_hands_each_decode_replica_at_most_its_local_limit(local_limit: int) -> None:
    """A burst far beyond one prefill replica: its queue fills, and the decode replicas take prompts
    only while they prefill fewer than `local_limit` themselves (counted from routing to the first
    token); the rest wait remotely, and every request finishes."""
    requests = synthetic("poisson", rate=40.0, num_requests=300, input_tokens=4096, output_tokens=16, seed=6)
    config = FleetConfig(profiles={"prefill": PROFILE, "decode": PROFILE}, prefill=1, decode=2,
                         disagg=DisaggConfig(threshold_tokens=256, queue_limit=2, local_limit=local_limit))
    sim = _simulate(config, requests)
    records = list(sim.records.values())
    assert all(r.finished for r in records)
    reasons = {(d, r): n for (d, r), n in sim.policy.counts.items()}
    assert reasons.get(("remote", "decode_worker_busy"), 0) > 0
    assert (reasons.get(("local", "prefill_queue_full"), 0) > 0) == (local_limit > 0)
    peaks = []
    for worker in ("decode-1", "decode-2"):
        spans = [(r.arrival_s, r.first_token_s) for r in records if r.worker == worker and r.prefill == "local"]
        edges = sorted([(a, 1) for a, _ in spans] + [(f, -1) for _, f in spans])  # a first token before an arrival
        depth = peak = 0
        for _, step in edges:
            depth += step
            peak = max(peak, depth)
        peaks.append(peak)
    assert max(peaks) == local_limit  # reached, never passed
    assert not +sim.local_prefills  # every count returned at its request's first token
