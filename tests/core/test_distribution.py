"""Server-mode distribution arithmetic: feasibility, per-rank chunk, proportional contiguous split, seeds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.distribution import (
    InfeasibleTopologyError,
    ServerSlice,
    consecutive_seed_runs,
    global_request_index,
    normalize_seed,
    per_rank_chunk,
    plan_rounds,
    rank_allotment,
    rollout_seed,
    split_contiguous,
    train_request_seeds,
)

world_sizes = st.lists(st.integers(1, 8), min_size=1, max_size=5)


def test_spec_scenario_infeasible_cap_names_the_three_fixes():
    # spec 004: decode_batch_size=1, S=2, W=4 fails fast
    with pytest.raises(InfeasibleTopologyError) as info:
        per_rank_chunk(1, [1, 1], 4)
    message = str(info.value)
    for fix in ("server world size", "learner world size", "decode_batch_size"):
        assert fix in message


@pytest.mark.parametrize(("dbs", "sizes", "w", "chunk"), [(8, [3], 1, 24), (8, [3], 2, 12), (1, [1, 1], 2, 1),
                                                         (4, [2, 1], 5, 2), (3, [1], 3, 1)])
def test_per_rank_chunk_is_floor_of_cap_times_servers_over_ranks(dbs, sizes, w, chunk):
    assert per_rank_chunk(dbs, sizes, w) == chunk


def test_equal_world_sizes_reduce_to_ceil_chunking_of_the_spec():
    # N=5, S=4 servers of world size 1: chunk_size = ceil(5/4) = 2 -> [0:2], [2:4], [4:5], and server 3 gets nothing
    assert split_contiguous(5, [1, 1, 1, 1]) == [ServerSlice(0, 0, 2), ServerSlice(1, 2, 4), ServerSlice(2, 4, 5)]
    assert split_contiguous(6, [2, 2]) == [ServerSlice(0, 0, 3), ServerSlice(1, 3, 6)]


def test_unequal_world_sizes_split_proportionally():
    # world sizes 3 and 1: server 0 may take ceil(8*3/4)=6, server 1 the remaining 2
    assert split_contiguous(8, [3, 1]) == [ServerSlice(0, 0, 6), ServerSlice(1, 6, 8)]
    assert split_contiguous(3, [1, 3]) == [ServerSlice(0, 0, 1), ServerSlice(1, 1, 3)]


def test_zero_requests_send_nothing():
    assert split_contiguous(0, [1, 2, 3]) == []
    assert plan_rounds(0, 4, [1]) == []


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 200), sizes=world_sizes)
def test_split_is_contiguous_ordered_complete_and_capped(n, sizes):
    slices = split_contiguous(n, sizes)
    assert slices == split_contiguous(n, sizes)  # deterministic
    covered = [k for s in slices for k in range(s.start, s.stop)]
    assert covered == list(range(n))  # order preserved, every request exactly once
    assert all(len(s) > 0 for s in slices)
    assert [s.server for s in slices] == sorted({s.server for s in slices})
    total = sum(sizes)
    for s in slices:
        assert len(s) <= math.ceil(n * sizes[s.server] / total)
    if len(set(sizes)) == 1 and n:
        size = math.ceil(n / len(sizes))
        assert [(s.start, s.stop) for s in slices] == [(i * size, min(n, (i + 1) * size))
                                                        for i in range(len(sizes)) if i * size < n]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 100), chunk=st.integers(1, 17), sizes=world_sizes)
def test_rounds_cover_requests_in_order_and_respect_the_chunk(n, chunk, sizes):
    rounds = plan_rounds(n, chunk, sizes)
    flat = [k for r in rounds for s in r for k in range(s.start, s.stop)]
    assert flat == list(range(n))
    assert all(sum(len(s) for s in r) <= chunk for r in rounds)
    assert len(rounds) == math.ceil(n / chunk)


@settings(max_examples=150, deadline=None)
@given(dbs=st.integers(1, 16), sizes=world_sizes, w=st.integers(1, 64))
def test_feasible_chunk_never_exceeds_the_per_gpu_cap(dbs, sizes, w):
    total = sum(sizes)
    if dbs * total < w:
        with pytest.raises(InfeasibleTopologyError):
            per_rank_chunk(dbs, sizes, w)
        return
    chunk = per_rank_chunk(dbs, sizes, w)
    assert chunk >= 1
    assert chunk * w <= dbs * total < (chunk + 1) * w


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(-2**40, 2**40), step=st.integers(0, 10**6), micro=st.integers(0, 64),
       rank=st.integers(0, 7), per_rank=st.integers(1, 32), i=st.integers(0, 31))
def test_seeds_are_never_zero_and_match_the_trainer(seed, step, micro, rank, per_rank, i):
    i = i % per_rank
    index = global_request_index(micro, rank, 8, per_rank, i)
    value = rollout_seed(seed, step, index)
    assert 1 <= value <= 2**31 - 1
    assert value == train_request_seeds(seed, step, micro, rank, 8, per_rank, per_rank)[i]  # what the pipeline draws


def test_seed_zero_maps_to_one_and_trainer_indices_are_distinct_per_step():
    assert normalize_seed(0) == 2**31 - 1 and normalize_seed(2**31) == 1 and normalize_seed(5) == 5
    assert normalize_seed(1) != normalize_seed(0)  # regression: 0 and 1 were both seed 1
    # trainer layout: micro-step major, then rank, then position: all (micro, rank, i) give distinct indices
    indices = {global_request_index(m, r, 2, 3, i) for m in range(4) for r in range(2) for i in range(3)}
    assert indices == set(range(24))


def test_consecutive_seed_runs_split_where_the_server_offset_would_differ():
    assert consecutive_seed_runs([5, 6, 7, 8], 0, 4) == [(0, 4)]
    assert consecutive_seed_runs([2**31 - 2, 2**31 - 1, 1, 2], 0, 4) == [(0, 2), (2, 4)]
    assert consecutive_seed_runs([9, 3, 4], 1, 3) == [(1, 3)]
    assert consecutive_seed_runs([1, 2], 1, 1) == []


@pytest.mark.parametrize(("dbs", "sizes", "w", "expected"), [
    # the two overloads seen in the issue: every rank used to start filling at server 0
    (1, [1, 1], 2, [[1, 0], [0, 1]]),
    (2, [1, 1, 1, 1], 4, [[2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0], [0, 0, 0, 2]]),
    (4, [2, 1], 1, [[8, 4]]),
    (3, [1, 2], 2, [[3, 1], [0, 4]]),
])
def test_rank_allotments_are_disjoint_slots_in_server_order(dbs, sizes, w, expected):
    assert [rank_allotment(dbs, sizes, w, r) for r in range(w)] == expected


@settings(max_examples=300, deadline=None)
@given(sizes=world_sizes, w=st.integers(1, 12), dbs=st.integers(1, 6), data=st.data())
def test_concurrent_load_per_server_never_exceeds_its_capacity(sizes, w, dbs, data):
    if dbs * sum(sizes) < w:
        with pytest.raises(InfeasibleTopologyError):
            rank_allotment(dbs, sizes, w, 0)
        return
    chunk = per_rank_chunk(dbs, sizes, w)
    load = [0] * len(sizes)
    for rank in range(w):
        allotment = rank_allotment(dbs, sizes, w, rank)
        assert allotment == rank_allotment(dbs, sizes, w, rank)  # deterministic
        assert sum(allotment) == chunk
        n = data.draw(st.integers(0, 3 * chunk), label=f"requests of rank {rank}")
        rank_peak = [0] * len(sizes)
        for round_slices in plan_rounds(n, chunk, allotment):
            assert [k for s in round_slices for k in range(s.start, s.stop)] == list(
                range(round_slices[0].start, round_slices[-1].stop))  # order kept inside a round
            for s in round_slices:
                assert len(s) <= allotment[s.server]
                rank_peak[s.server] = max(rank_peak[s.server], len(s))
        load = [a + b for a, b in zip(load, rank_peak)]
    # every rank sending its largest round at the same moment still fits every server
    assert all(load[i] <= dbs * sizes[i] for i in range(len(sizes)))


def test_split_skips_servers_outside_the_allotment():
    assert split_contiguous(3, [0, 2, 0, 1]) == [ServerSlice(1, 0, 2), ServerSlice(3, 2, 3)]
    with pytest.raises(ValueError, match="at least one"):
        split_contiguous(1, [0, 0])
