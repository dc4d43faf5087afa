"""BlockIndex: the byte budget, eviction order, children before parents, pins."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.kv.tiers.policy import BlockIndex

# One op: (kind, block id 0..39, size); parents come from a fixed forest: block i's parent is i // 2.
ops_strategy = st.lists(st.tuples(st.sampled_from(["admit", "touch", "remove", "pin", "unpin"]),
                                  st.integers(0, 39), st.integers(1, 50)), max_size=200)


def _parent(block: int) -> int | None:
    return None if block == 0 else block // 2


@settings(max_examples=300, deadline=None)
@given(ops=ops_strategy, capacity=st.integers(1, 400), policy=st.sampled_from(["lru", "lfu"]))
def test_budget_children_and_pins_hold_under_random_ops(ops: list, capacity: int, policy: str) -> None:
    index = BlockIndex(capacity, policy, max_pinned=5)
    for kind, block, size in ops:
        if kind == "admit" and block not in index:
            admission = index.admit(block, size, _parent(block))
            assert admission.admitted == (block in index)
            assert block not in [victim for victim, _ in admission.evicted]
            for victim, _ in admission.evicted:
                assert victim not in index.pinned
                assert all(e.parent != victim for e in index.entries.values()), "parent left before a child"
        elif kind == "touch":
            index.touch(block)
        elif kind == "remove":
            index.remove(block)
        elif kind == "pin":
            index.pin([block])
        else:
            index.unpin([block])
        assert index.used_bytes == sum(e.size for e in index.entries.values()) <= capacity
        assert len(index.pinned) <= 5


def test_lru_evicts_least_recently_used_leaf() -> None:
    index = BlockIndex(30)
    for block in (1, 2, 3):
        assert index.admit(block, 10, None).admitted
    index.touch(1)
    assert [h for h, _ in index.admit(4, 10, None).evicted] == [2]


def test_lfu_evicts_least_used_then_oldest() -> None:
    index = BlockIndex(30, "lfu")
    for block in (1, 2, 3):
        index.admit(block, 10, None)
    index.touch(1)
    index.touch(1)
    index.touch(2)
    assert [h for h, _ in index.admit(4, 10, None).evicted] == [3]
    assert [h for h, _ in index.admit(5, 10, None).evicted] == [4]


def test_parent_outlives_children_even_when_children_arrive_first() -> None:
    index = BlockIndex(30)
    index.admit(12, 10, 11)  # the device frees chains tail first: child, then parent
    index.admit(11, 10, 10)
    index.admit(10, 10, None)
    evicted = [h for h, _ in index.admit(99, 30, None).evicted]
    assert evicted == [12, 11, 10]


def test_admitting_a_child_never_evicts_its_parent() -> None:
    index = BlockIndex(20)
    index.admit(1, 10, None)
    admission = index.admit(2, 15, 1)
    assert not admission.admitted and 1 in index and 2 not in index
    assert index.used_bytes == 10


def test_a_block_whose_child_is_evicted_for_it_is_never_its_own_victim() -> None:
    index = BlockIndex(20)
    index.admit(1, 10, None)
    index.admit(3, 5, 2)  # the child of 2 arrived first
    admission = index.admit(2, 12, 1)  # evicting 3 frees 2 itself, and still leaves too little room
    assert not admission.admitted and 2 not in index
    assert [h for h, _ in admission.evicted] == [3] and 1 in index and index.used_bytes == 10


def test_pinned_blocks_stay_and_cap_is_enforced() -> None:
    index = BlockIndex(20, max_pinned=2)
    assert index.pin([1, 2])
    assert not index.pin([3]) and 3 not in index.pinned
    index.admit(1, 10, None)
    index.admit(2, 10, None)
    assert not index.admit(3, 10, None).admitted  # everything present is pinned
    index.unpin([1])
    assert [h for h, _ in index.admit(3, 10, None).evicted] == [1]


@pytest.mark.parametrize("bad", [{"capacity_bytes": 0}, {"capacity_bytes": 10, "policy": "fifo"},
                                 {"capacity_bytes": 10, "max_pinned": -1}])
def test_bad_configuration_is_a_value_error(bad: dict) -> None:
    with pytest.raises(ValueError):
        BlockIndex(**bad)
