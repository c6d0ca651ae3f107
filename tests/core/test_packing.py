"""Post-rollout packing selection (decision 8) and the carry buffer."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.packing import CarryBuffer, PackingLimitError, fifo_greedy_selection, select_segments


def total(lengths, indices):
    return sum(lengths[i] for i in indices)


def fifo_stop_at_first_misfit(lengths, capacity):
    selected, acc = [], 0
    for i, length in enumerate(lengths):
        if acc + length > capacity:
            break
        selected.append(i)
        acc += length
    return selected


@pytest.mark.parametrize(
    "lengths, capacity, expected",
    [
        ([6, 3, 2, 2, 2], 10, [0, 2, 3]),  # FIFO gives 9 (6+3); binpacking finds 6+2+2 = 10
        ([6, 3, 2, 2], 10, [0, 2, 3]),
        ([5, 5, 5], 10, [0, 1]),
        ([8, 2, 2, 3], 10, [0, 1]),  # upstream HEAD returned [0] here (total 8 < FIFO 10)
        ([5, 2, 2, 4], 9, [0, 3]),  # 5+2+2 and 5+4 both fill 9: fewer segments wins
        ([5, 4, 4], 9, [0, 1]),  # equal total and count: lexicographically smallest index set
        ([3], 10, [0]),
        ([10, 1, 1], 10, [0]),
    ],
)
def test_selection_hand_examples(lengths, capacity, expected):
    assert select_segments(lengths, capacity) == expected


def test_fifo_greedy_skips_misfits_and_dominates_stop_at_first():
    assert fifo_greedy_selection([6, 5, 3, 1], 10) == [0, 2, 3]  # 6, skip 5, then 3 and 1
    assert fifo_stop_at_first_misfit([6, 5, 3, 1], 10) == [0]


def test_upstream_head_regression_never_selects_less_than_fifo():
    lengths = [7, 1, 5, 9, 8]
    for capacity in range(7, 31):
        chosen = select_segments(lengths, capacity)
        assert total(lengths, chosen) >= total(lengths, fifo_greedy_selection(lengths, capacity))


def test_oldest_over_capacity_and_bad_inputs_fail_with_guidance():
    with pytest.raises(ValueError, match="oldest segment .* exceeds packing_length=10.*training.packing: false"):
        select_segments([11, 2], 10)
    with pytest.raises(ValueError, match="empty"):
        select_segments([], 10)
    with pytest.raises(ValueError, match="positive int"):
        select_segments([3, 0], 10)
    with pytest.raises(ValueError, match="capacity"):
        select_segments([3], 0)


def test_missing_binpacking_fails_with_install_or_disable_guidance(monkeypatch):
    monkeypatch.setitem(sys.modules, "binpacking", None)  # makes `import binpacking` raise ImportError
    with pytest.raises(ImportError, match=r"pip install binpacking.*training\.packing: false"):
        select_segments([3, 2], 10)
    with pytest.raises(ImportError, match="binpacking"):
        CarryBuffer(packing_length=10, max_segments=4)


lengths_and_capacity = st.integers(1, 120).flatmap(
    lambda cap: st.tuples(
        st.lists(st.integers(1, cap + 20), min_size=0, max_size=24).flatmap(
            lambda rest: st.integers(1, cap).map(lambda first: [first, *rest])
        ),
        st.just(cap),
    )
)


@settings(max_examples=300, deadline=None)
@given(lengths_and_capacity)
def test_selection_properties(case):
    lengths, capacity = case
    chosen = select_segments(lengths, capacity)
    assert chosen[0] == 0  # the oldest is always in
    assert chosen == sorted(set(chosen))  # unique, insertion order
    assert all(0 <= i < len(lengths) for i in chosen)
    assert total(lengths, chosen) <= capacity
    assert total(lengths, chosen) >= total(lengths, fifo_greedy_selection(lengths, capacity))
    assert total(lengths, chosen) >= total(lengths, fifo_stop_at_first_misfit(lengths, capacity))
    assert select_segments(list(lengths), capacity) == chosen  # deterministic


# ------------------------------------------------------------------ carry buffer


def test_buffer_pops_selection_in_insertion_order_and_carries_leftovers():
    buf = CarryBuffer(packing_length=10, max_segments=8)
    buf.add_many([("a", 6), ("b", 3), ("c", 2), ("d", 2), ("e", 2)])
    assert len(buf) == 5 and buf.total_length == 15
    first = buf.pop_packed()
    assert first.items == ("a", "c", "d") and first.lengths == (6, 2, 2)
    assert first.total_length == 10 and first.fill_ratio == 1.0 and first.remaining == 2
    assert buf.lengths == (3, 2)  # "b" is now the oldest
    buf.add("f", 7)
    second = buf.pop_packed()
    assert second.items == ("b", "f") and second.fill_ratio == 1.0
    third = buf.pop_packed()
    assert third.items == ("e",) and third.fill_ratio == pytest.approx(0.2) and len(buf) == 0
    with pytest.raises(ValueError, match="empty carry buffer"):
        buf.pop_packed()


def test_oversized_segment_is_rejected_at_insertion_with_mitigations():
    buf = CarryBuffer(packing_length=10, max_segments=4)
    buf.add("a", 4)
    with pytest.raises(ValueError, match="encoded_len=11 > packing_length=10.*global_max_length.*max_new_tokens"):
        buf.add("big", 11)
    assert buf.lengths == (4,)


def test_overflow_is_rejected_and_add_many_is_all_or_nothing():
    buf = CarryBuffer(packing_length=10, max_segments=3)
    buf.add_many([("a", 1), ("b", 2)])
    with pytest.raises(ValueError, match="training.packing_buffer=3.*batch size"):
        buf.add_many([("c", 1), ("d", 1)])
    with pytest.raises(ValueError, match="packing_length"):
        buf.add_many([("c", 1), ("x", 99)])  # the first entry fits, the second does not
    assert buf.lengths == (1, 2)
    buf.add("c", 1)
    with pytest.raises(ValueError, match="overflow"):
        buf.add("d", 1)
    assert len(buf) == 3


def test_buffer_rejects_bad_configuration():
    with pytest.raises(ValueError, match="packing_buffer"):
        CarryBuffer(packing_length=10, max_segments=0)
    with pytest.raises(ValueError, match="packing_length"):
        CarryBuffer(packing_length=-1, max_segments=2)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(5, 50),
    st.integers(1, 6),
    st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=4), min_size=1, max_size=8),
)
def test_buffer_state_is_unchanged_after_a_rejected_add(capacity, max_segments, batches):
    buf = CarryBuffer(packing_length=capacity, max_segments=max_segments)
    popped = []
    for step, batch in enumerate(batches):
        before = (buf.lengths, len(buf), buf.total_length)
        entries = [((step, j), length) for j, length in enumerate(batch)]
        try:
            buf.add_many(entries)
        except ValueError:
            assert (buf.lengths, len(buf), buf.total_length) == before
        else:
            assert buf.lengths == before[0] + tuple(batch)
        if len(buf):
            selection = buf.pop_packed()
            assert selection.total_length <= capacity and selection.remaining == len(buf)
            popped.extend(selection.items)
    assert len(set(popped)) == len(popped)  # never popped twice


def test_pop_rows_trains_every_row_a_step_needs():
    """Three rows' worth of segments in one step: three rows come out, oldest first, and nothing is carried."""
    buffer = CarryBuffer(packing_length=10, max_segments=64)
    buffer.add_many([(name, 5) for name in "abcdef"])
    rows = buffer.pop_rows(keep_at_most=6)
    assert [row.items for row in rows] == [("a", "b"), ("c", "d"), ("e", "f")]
    assert [row.total_length for row in rows] == [10, 10, 10]
    assert len(buffer) == 0


def test_pop_rows_carries_less_than_a_row_and_at_most_one_steps_segments():
    buffer = CarryBuffer(packing_length=10, max_segments=64)
    buffer.add_many([("a", 6), ("b", 6), ("c", 3)])
    rows = buffer.pop_rows(keep_at_most=3)
    assert [row.items for row in rows] == [("a", "c")]  # 6 left: under a row, kept for the next step
    assert buffer.lengths == (6,)
    with pytest.raises(ValueError, match="keep_at_most"):
        buffer.pop_rows(keep_at_most=-1)


def test_overflow_case_from_the_issue_never_grows_with_pop_rows():
    """Batch 16 of ~300-token segments into 2048-token rows (one row holds ~6): one pop per step grew the carry
    by ~10 segments a step until ``packing_buffer=64`` overflowed; pop_rows keeps it bounded for 50 steps."""
    one_row = CarryBuffer(packing_length=2048, max_segments=64)
    with pytest.raises(PackingLimitError, match="carry buffer overflow"):
        for _ in range(50):
            one_row.add_many([(0, 300 + 7 * i) for i in range(16)])
            one_row.pop_packed()
    buffer = CarryBuffer(packing_length=2048, max_segments=64)
    for step in range(50):
        buffer.add_many([(step, 300 + 7 * i) for i in range(16)])
        rows = buffer.pop_rows(keep_at_most=16)
        assert len(buffer) <= 16 and buffer.total_length < 2048
        assert all(row.total_length <= 2048 for row in rows)


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 60),
    steps=st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=12), min_size=1, max_size=8),
)
def test_pop_rows_properties(capacity, steps):
    """Every segment is trained exactly once or carried, rows fit, and the carry is under a row and one step."""
    buffer = CarryBuffer(packing_length=capacity, max_segments=10_000)
    seen, trained = [], []
    for step, lengths in enumerate(steps):
        entries = [((step, i), min(length, capacity)) for i, length in enumerate(lengths)]
        seen += [item for item, _ in entries]
        buffer.add_many(entries)
        rows = buffer.pop_rows(keep_at_most=len(entries))
        assert rows and all(0 < row.total_length <= capacity for row in rows)
        trained += [item for row in rows for item in row.items]
        assert len(buffer) <= len(entries) and buffer.total_length < capacity
    carried = [item for item in seen if item not in set(trained)]
    assert sorted(trained + carried) == sorted(seen) and len(set(trained)) == len(trained)
    assert len(carried) == len(buffer)
