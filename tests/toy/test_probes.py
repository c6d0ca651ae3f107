"""The grid task's figures and gate (coordexp/runtime/toy/probes.py) on hand-built predictions, and the invariants
of the figure functions on random ones."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.train.probe import ProbeCase, probe_cases
from coordexp.runtime.train.probe import probe_figures as _probe_figures
from coordexp.runtime.toy.probes import (GateThresholds, aggregate_figures, backtracks, cell_precision, gate,
                                         greedy_match, image_figures)


def box(x1, y1, x2, y2):
    return DetObject("box", "bbox_2d", (x1, y1, x2, y2))


# a 4 x 4 grid (cells of 250 bins): GT in cells 0, 1, 5 (row-major)
GT = [box(20, 20, 200, 200), box(270, 30, 480, 220), box(280, 280, 470, 460)]


def test_order_of_writing_decides_matches_and_duplicates():
    preds = [GT[0], box(22, 22, 198, 198), GT[2], box(600, 600, 700, 700)]
    taken, duplicate = greedy_match(preds, GT)
    assert taken == [0, None, 2, None]
    assert duplicate == [False, True, False, False]  # the 2nd overlaps GT 0, already taken; the 4th overlaps nothing


def test_image_figures_on_a_skip_a_duplicate_and_an_early_stop():
    preds = [GT[0], GT[0], GT[2]]  # skipped GT 1, repeated GT 0, then stopped
    f = image_figures(preds, GT, eos_stopped=True, tokens=90)
    assert (f.n_pred, f.n_gt, f.matched, f.duplicates) == (3, 3, 2, 1)
    assert f.rank_hit == (True, False, True)
    assert f.next_correct == (True, False, True)  # the r-th prediction is GT object r: not the repeat, yes the 3rd
    assert not f.premature_eos  # as many predictions as objects: not an early stop
    short = image_figures([GT[0]], GT, eos_stopped=True)
    assert short.premature_eos and short.next_correct == (True, False, False)
    assert not image_figures([GT[0]], GT, eos_stopped=False).premature_eos  # cut by the guard/length: not EOS


def test_aggregate_figures_by_hand():
    a = image_figures([GT[0], GT[1], GT[2]], GT, eos_stopped=True, tokens=100)  # perfect
    b = image_figures([GT[0], box(600, 600, 700, 700)], GT, eos_stopped=True, tokens=50)  # 1 TP, 1 FP, stops early
    agg = aggregate_figures([a, b])
    assert agg["precision"] == pytest.approx(4 / 5)
    assert agg["recall"] == pytest.approx(4 / 6)
    assert agg["f1"] == pytest.approx(2 * (4 / 5) * (4 / 6) / (4 / 5 + 4 / 6))
    assert agg["recall_by_rank"] == [1.0, 0.5, 0.5]
    assert agg["premature_eos_rate"] == 0.5
    assert agg["count_error"] == pytest.approx((0 + 1) / 2)
    assert agg["duplicates_per_image"] == 0.0
    assert agg["rollout_tokens_per_image"] == 75.0


def test_backtracks_count_going_back_in_reading_order():
    assert backtracks(GT, GT) == (0, 0)  # the reading order: never back
    assert backtracks([GT[0], GT[2], GT[1]], GT) == (1, 1)  # skipped GT 1, went back for it: a recovery
    assert backtracks([GT[0], GT[1], GT[2], GT[1]], GT) == (1, 0)  # went back to a written object: a duplicate
    assert backtracks([GT[1], GT[1]], GT) == (0, 0)  # a repeat in place is a duplicate, not a backtrack
    assert backtracks([GT[2], box(600, 600, 700, 700), GT[0], GT[0]], GT) == (2, 1)  # an FP moves nothing
    f = image_figures([GT[0], GT[2], GT[1], GT[0]], GT, eos_stopped=True)
    assert (f.backtracks, f.backtrack_recoveries, f.duplicates) == (2, 1, 1)
    agg = aggregate_figures([f, image_figures(GT, GT, eos_stopped=True)])
    assert agg["backtracks_per_image"] == 1.0 and agg["backtrack_recovery_rate"] == 0.5
    assert aggregate_figures([image_figures(GT, GT, eos_stopped=True)])["backtrack_recovery_rate"] is None


def test_cell_precision_counts_first_objects_in_occupied_cells_that_match():
    preds = [GT[0], box(520, 20, 700, 200), box(300, 300, 340, 340), GT[1]]  # ok, empty cell, cell 5 but IoU < .5
    assert cell_precision([preds], [GT], cells=4, first_k=3) == pytest.approx(1 / 3)
    assert cell_precision([preds], [GT], cells=4, first_k=4) == pytest.approx(2 / 4)
    assert cell_precision([[]], [GT], cells=4) is None


def test_probe_figures_by_hand():
    class Rec:
        objects = tuple(GT)

    records = [Rec(), Rec()]
    cases = [ProbeCase(0, "tf", tuple(GT), 1, 1), ProbeCase(1, "tf", tuple(GT), 2, 2),
             ProbeCase(0, "deletion", (GT[0], GT[2]), 2, 1), ProbeCase(1, "deletion", (GT[0], GT[2]), 2, 1),
             ProbeCase(0, "duplicate", (GT[0], GT[0], GT[1], GT[2]), 2, 0)]
    written = [[GT[1]], [GT[0]], [GT[1]], [], [GT[2], GT[2]]]
    free_next = [(True, False, False), (True, True, True)]
    f = _probe_figures(records, cases, written, free_next)
    assert f["next_object_tf"] == 0.5  # image 0 rank 1 right, image 1 rank 2 wrong
    assert f["next_object_free"] == 0.5  # image 0 rank 1 wrong, image 1 rank 2 right
    assert f["exposure_gap"] == 0.0
    assert f["deletion_recovery"] == 0.5
    assert f["duplicate_probe"] == 0.5  # of GT 1, GT 2 after the repeated GT 0, only GT 2 written


def test_probe_cases_leave_out_the_middle_and_repeat_the_last():
    class Rec:
        def __init__(self, n):
            self.objects = tuple(box(10 * k, 0, 10 * k + 5, 5) for k in range(n))

    cases = probe_cases([Rec(1), Rec(2), Rec(5)], seed=3)
    assert [(c.image, c.kind) for c in cases] == [(1, "tf"), (1, "duplicate"), (2, "tf"), (2, "duplicate"),
                                                  (2, "deletion")]
    deletion = cases[-1]
    gts = Rec(5).objects
    assert deletion.rank == 2 and deletion.objects == gts[:2] + gts[3:] and deletion.n_prefix == 3
    duplicate = cases[-2]
    assert duplicate.objects[:3] == (gts[0], gts[1], gts[1]) and duplicate.n_prefix == 3 and duplicate.rank == 1
    assert all(1 <= c.rank <= len(Rec(5).objects) - 1 for c in cases if c.kind == "tf")


def test_gate_passes_only_with_perception_and_a_gap():
    ok = {"cell_precision": 0.9, "exposure_gap": 0.1, "premature_eos_rate": 0.0}
    assert gate(ok).passed
    assert not gate({**ok, "cell_precision": 0.5}).passed
    assert not gate({**ok, "exposure_gap": 0.0}).passed
    assert gate({**ok, "exposure_gap": 0.0, "premature_eos_rate": 0.2}).passed  # early stops are a gap too
    assert not gate({}).passed
    assert "FAILED" in gate({}).line() and "PASSED" in gate(ok, GateThresholds()).line()


coords = st.integers(0, 990).flatmap(lambda x: st.integers(0, 990).flatmap(
    lambda y: st.tuples(st.just(x), st.just(y), st.integers(x + 1, 1000), st.integers(y + 1, 1000))))
boxes = st.lists(coords.map(lambda c: box(*c)), max_size=8)


@settings(max_examples=150, deadline=None)
@given(preds=boxes, gts=boxes, eos=st.booleans())
def test_figure_invariants(preds, gts, eos):
    f = image_figures(preds, gts, eos_stopped=eos)
    taken, duplicate = greedy_match(preds, gts)
    matched = [g for g in taken if g is not None]
    assert len(matched) == len(set(matched)) == f.matched <= min(len(preds), len(gts))  # one-to-one
    assert not any(d and g is not None for d, g in zip(duplicate, taken))
    assert f.duplicates + f.matched <= len(preds)
    assert sum(f.next_correct) <= f.matched and sum(f.rank_hit) == f.matched
    assert 0 <= f.backtrack_recoveries <= f.backtracks <= len(preds) - 1 if preds else f.backtracks == 0
    assert f.backtracks - f.backtrack_recoveries <= f.duplicates  # a backtrack that found nothing new repeats
    agg = aggregate_figures([f])
    for key in ("precision", "recall", "f1", "premature_eos_rate", "duplicates_per_image"):
        assert agg[key] is None or 0.0 <= agg[key] <= (len(preds) if key == "duplicates_per_image" else 1.0)
    assert all(v is None or 0.0 <= v <= 1.0 for v in agg["recall_by_rank"])
    assert agg["count_error"] == abs(len(preds) - len(gts))
    cp = cell_precision([preds], [gts], cells=4)
    assert cp is None or 0.0 <= cp <= 1.0
