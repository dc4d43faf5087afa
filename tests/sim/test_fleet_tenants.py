"""Tenants in the fleet simulator: the frontend's slots go by class and fair share (the live
frontend's own `FairShare`), and a class is the engine's priority, so an interactive tenant's first
tokens hardly wait behind a batch flood, backlogged tenants get tokens by weight whatever their
request counts, and no slot is held past its request."""
from __future__ import annotations

import pytest

from tokenmill.sim.fleet.arrivals import TraceRequest
from tokenmill.sim.fleet.clock import parse_profile
from tokenmill.sim.fleet.config import FleetConfig
from tokenmill.sim.fleet.fleet import FleetSim
from tokenmill.tenants.config import Tenant

PROFILE = parse_profile("llama-3.1-70b@h100:fp8:tp4")
PROMPT, OUTPUT = 256, 64


def _requests(tenant: str, count: int, first: int, every_s: float = 0.0, start_s: float = 0.0,
              output: int = OUTPUT) -> list[TraceRequest]:
    blocks = PROMPT // 16
    return [TraceRequest(f"{tenant}-{i}", start_s + i * every_s, PROMPT, output,
                         tuple(range((first + i) * blocks + 1, (first + i + 1) * blocks + 1)), tenant)
            for i in range(count)]


def _run(tenants: tuple[Tenant, ...], requests: list[TraceRequest], max_in_flight: int, **fleet) -> FleetSim:
    config = FleetConfig(profiles={"agg": PROFILE}, agg=1, max_num_seqs=8, max_num_batched_tokens=512,
                         tenants=tenants, max_in_flight=max_in_flight, **fleet)
    sim = FleetSim(config)
    sim.run(sorted(requests, key=lambda r: r.arrival_s))
    assert all(r.finished for r in sim.records.values())  # nothing lost, the flood included
    assert sim.admission.share.in_flight == 0 and sim.admission.waiting() == 0 and not sim.admission.slots
    return sim


def _ttft_p90(sim: FleetSim, prefix: str) -> float:
    ttfts = sorted(r.ttft_s for r in sim.records.values() if r.request_id.startswith(prefix))
    return ttfts[int(0.9 * (len(ttfts) - 1))]


def test_with_classes_an_interactive_tenants_first_tokens_hardly_wait_behind_a_batch_flood() -> None:
    interactive = _requests("assistant", 40, first=0, every_s=0.5, start_s=0.25, output=16)
    flood = _requests("sweeps", 400, first=100)
    alone = _run((Tenant("assistant", (), "interactive"),), interactive, 10)
    one_class = _run((Tenant("assistant", (), "standard"), Tenant("sweeps", (), "standard")), interactive + flood, 10)
    classes = _run((Tenant("assistant", (), "interactive"), Tenant("sweeps", (), "batch")), interactive + flood, 10)
    unloaded = _ttft_p90(alone, "assistant")
    assert _ttft_p90(one_class, "assistant") > 10 * unloaded  # it waits for a batch request to free a slot
    assert _ttft_p90(classes, "assistant") < 3 * unloaded  # a slot is kept for it and its prefill goes first
    # and the batch tenant still gets its work done, nearly as fast: it holds 8 of the 10 slots
    def makespan(sim: FleetSim) -> float:
        return max(r.last_token_s for r in sim.records.values() if r.request_id.startswith("sweeps"))

    assert makespan(classes) <= 1.25 * makespan(one_class)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0)])
def test_backlogged_tenants_get_tokens_by_weight_whatever_their_request_counts(weights: tuple[float, float]) -> None:
    heavy, light = (Tenant("heavy", (), "standard", weights[0]), Tenant("light", (), "standard", weights[1]))
    requests = _requests("heavy", 600, first=0) + _requests("light", 60, first=1000)
    sim = _run((heavy, light), requests, 4)
    # while both are backlogged: up to the moment the light tenant's last request got its first token
    until = max(r.first_token_s for r in sim.records.values() if r.request_id.startswith("light"))
    served = {name: sum(r.input_tokens + r.tokens for r in sim.records.values()
                        if r.request_id.startswith(name) and r.last_token_s is not None and r.last_token_s <= until)
              for name in ("heavy", "light")}
    assert served["heavy"] / served["light"] == pytest.approx(weights[0] / weights[1], rel=0.1)


def test_without_tenants_every_request_is_the_default_tenants_and_goes_in_arrival_order() -> None:
    requests = _requests("", 30, first=0, every_s=0.01)
    sim = _run((), requests, 2)
    firsts = [sim.records[r.request_id].first_token_s for r in requests]
    assert firsts == sorted(firsts)
