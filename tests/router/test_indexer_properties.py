"""The index agrees with a brute-force model (worker -> tier -> set of hashes) after random events."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.kv.events import TIERS, AllCleared, BlockRemoved, BlockStored, KVEvent
from tokenmill.router.indexer import ApplyStatus, KVIndexer

WORKERS = ("w0", "w1", "w2")
PREFERENCE = ("device", "host", "shared", "disk")
hash_values = st.integers(min_value=0, max_value=12)
hash_lists = st.lists(hash_values, min_size=1, max_size=6)

Model = dict[str, dict[str, set[int]]]


@st.composite
def event_specs(draw: st.DrawFn) -> tuple[str, str, str, list[int], int | None]:
    kind = draw(st.sampled_from(("stored", "stored", "removed", "cleared")))
    return (kind, draw(st.sampled_from(WORKERS)), draw(st.sampled_from(TIERS)), draw(hash_lists),
            draw(st.one_of(st.none(), hash_values)))


def build_events(specs: list[tuple[str, str, str, list[int], int | None]]) -> list[KVEvent]:
    next_id = dict.fromkeys(WORKERS, 0)
    events: list[KVEvent] = []
    for kind, worker, tier, hashes, parent in specs:
        event_id = next_id[worker]
        next_id[worker] += 1
        if kind == "stored":
            events.append(BlockStored(worker, tier, parent, tuple(hashes), event_id))
        elif kind == "removed":
            events.append(BlockRemoved(worker, tier, tuple(hashes), event_id))
        else:
            events.append(AllCleared(worker, event_id))
    return events


def apply_to_model(model: Model, event: KVEvent) -> None:
    tiers = model.setdefault(event.worker, {tier: set() for tier in TIERS})
    if isinstance(event, BlockStored):
        tiers[event.tier].update(event.hashes)
    elif isinstance(event, BlockRemoved):
        tiers[event.tier].difference_update(event.hashes)
    else:
        for held in tiers.values():
            held.clear()


def model_match(model: Model, query: list[int]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for worker, tiers in model.items():
        counts: dict[str, int] = {}
        for block_hash in query:
            tier = next((t for t in PREFERENCE if block_hash in tiers[t]), None)
            if tier is None:
                break
            counts[tier] = counts.get(tier, 0) + 1
        if counts:
            out[worker] = counts
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(event_specs(), max_size=40), st.lists(st.lists(hash_values, max_size=10), min_size=1, max_size=8))
def test_index_matches_brute_force_model(specs: list, queries: list[list[int]]) -> None:
    index, model = KVIndexer(PREFERENCE), {}
    for event in build_events(specs):
        assert index.apply(event) is ApplyStatus.APPLIED
        apply_to_model(model, event)
    for query in queries:
        assert index.match(query) == model_match(model, query)
    assert index.num_blocks() == sum(len(s) for tiers in model.values() for s in tiers.values())
    for worker, tiers in model.items():
        assert index.worker_blocks(worker) == {t: s for t, s in tiers.items() if s}


@settings(max_examples=100, deadline=None)
@given(st.lists(event_specs(), min_size=1, max_size=40), st.data())
def test_lost_events_are_repaired_by_a_snapshot(specs: list, data: st.DataObject) -> None:
    events = build_events(specs)
    lost = data.draw(st.sets(st.integers(0, len(events) - 1)), label="lost")
    index, model = KVIndexer(PREFERENCE), {}
    gapped: set[str] = set()
    for position, event in enumerate(events):
        apply_to_model(model, event)
        if position in lost:
            continue
        if index.apply(event) is ApplyStatus.GAP:
            gapped.add(event.worker)
    for worker in sorted(gapped):  # each answers with its state as of its last event
        last = max(e.event_id for e in events if e.worker == worker)
        status = index.apply_snapshot(worker, model[worker], last)
        assert status is ApplyStatus.APPLIED
    for worker in model:
        # a worker whose lost events were its last shows no gap yet; the others are exact
        last_seen = index.last_event_id(worker)
        if last_seen == max(e.event_id for e in events if e.worker == worker):
            assert index.worker_blocks(worker) == {t: s for t, s in model[worker].items() if s}
    assert index.awaiting_snapshot() == []
