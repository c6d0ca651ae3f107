"""Set figures (coordexp/runtime/core/set_figures.py): class-aware and class-agnostic matching, certified duplicates
and the aggregate rates, on hand-built images and as properties of random ones."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.set_figures import (FIGURE_NAMES, aggregate_figures, certified_duplicates, greedy_match,
                                               image_figures, near_repeats)


def box(x1, y1, x2, y2, desc="cat"):
    return DetObject(desc, "bbox_2d", (x1, y1, x2, y2))


CAT, DOG = box(10, 10, 200, 200), box(300, 300, 500, 500, "dog")


def test_a_box_on_the_right_place_with_the_wrong_class_counts_only_class_agnostically():
    preds = [CAT, box(300, 300, 500, 500, "cat")]  # the second sits on the dog but says cat
    f = aggregate_figures([image_figures(preds, [CAT, DOG], eos_stopped=True)])
    assert (f["precision"], f["recall"]) == (0.5, 0.5)
    assert (f["precision_any_class"], f["recall_any_class"], f["f1_any_class"]) == (1.0, 1.0, 1.0)
    assert f["f1"] == pytest.approx(0.5)
    assert f["recall_by_rank"] == [1.0, 0.0]  # class-aware, per reading-order rank
    assert greedy_match(preds, [CAT, DOG], class_aware=True)[0] == [0, None]


def test_certified_duplicates_by_hand():
    near = box(12, 11, 199, 201)  # IoU with CAT > 0.9, same desc
    assert certified_duplicates([CAT, near, CAT], [CAT, DOG]) == [False, True, True]
    # without labels only the prediction rule: same desc and IoU >= 0.9 with an earlier kept prediction
    assert near_repeats([CAT, near, box(12, 11, 199, 201, "dog")]) == [False, True, False]
    # a second cat right on a second ground-truth cat is a true positive, never a duplicate
    twin = box(11, 10, 201, 200)
    assert certified_duplicates([CAT, twin], [CAT, twin]) == [False, False]
    # an object overlapping a taken one at IoU 0.5..0.9 with another desc: the ground-truth rule only
    half = box(10, 10, 200, 90, "dog")
    assert certified_duplicates([CAT, half], [CAT]) == [False, False]  # IoU < 0.5 with the cat: a plain FP
    assert certified_duplicates([CAT, box(10, 10, 200, 160, "dog")], [CAT]) == [False, True]


def test_aggregate_rates_by_hand():
    a = image_figures([CAT, CAT, DOG], [CAT, DOG], eos_stopped=True, tokens=30)  # one repeat
    b = image_figures([CAT], [CAT, DOG], eos_stopped=False, tokens=512, cut_off=True)  # cut off after one
    f = aggregate_figures([a, b])
    assert f["pred_per_gt"] == pytest.approx(4 / 4)
    assert f["duplicates_per_image"] == pytest.approx(0.5)
    assert f["cut_off_rate"] == 0.5 and f["premature_eos_rate"] == 0.0  # b stopped by the limit, not EOS
    assert f["precision"] == pytest.approx(3 / 4) and f["recall"] == pytest.approx(3 / 4)
    assert f["count_error"] == pytest.approx((1 + 1) / 2)
    assert set(FIGURE_NAMES) <= set(f)
    empty = aggregate_figures([])
    assert all(empty[k] is None for k in FIGURE_NAMES) and empty["recall_by_rank"] == []


DESCS = st.sampled_from(["cat", "dog"])
coords = st.integers(0, 990).flatmap(lambda x: st.integers(0, 990).flatmap(
    lambda y: st.tuples(st.just(x), st.just(y), st.integers(x + 1, 1000), st.integers(y + 1, 1000))))
objects = st.lists(st.tuples(coords, DESCS).map(lambda t: box(*t[0], desc=t[1])), max_size=8)


def _matches(preds, gts, class_aware):
    return sum(g is not None for g in greedy_match(preds, gts, class_aware=class_aware)[0])


@settings(max_examples=200, deadline=None)
@given(preds=objects, gts=objects, repeat=st.lists(st.integers(0, 7), max_size=4))
def test_removing_certified_duplicates_never_costs_a_true_positive(preds, gts, repeat):
    preds = list(preds) + [preds[i] for i in repeat if i < len(preds)]  # exact repeats are certified
    flags = certified_duplicates(preds, gts)
    kept = [p for p, dup in zip(preds, flags) if not dup]
    for class_aware in (False, True):
        assert _matches(kept, gts, class_aware) == _matches(preds, gts, class_aware)
    f = image_figures(preds, gts, eos_stopped=True)
    assert f.duplicates == sum(flags) and f.duplicates + f.matched <= len(preds)
    assert f.matched_class == sum(f.rank_hit)


@settings(max_examples=150, deadline=None)
@given(preds=objects)
def test_without_labels_a_duplicate_repeats_an_earlier_kept_prediction(preds):
    from coordexp.runtime.core.set_figures import iou_matrix

    flags = near_repeats(preds)
    ious = iou_matrix(preds, preds)
    for k, dup in enumerate(flags):
        earlier = [j for j in range(k) if not flags[j] and preds[j].desc == preds[k].desc and ious[k, j] >= 0.9]
        assert dup == bool(earlier)


def test_the_label_free_rule_is_a_heuristic_that_can_remove_the_only_true_positive():
    """Regression (issue 56, item 7): docs/figures.md said the label-free removal never costs a true positive; that
    holds for the ground-truth rule only. A written first at IoU 0.48 with the object, B at 0.52, IoU(A, B) 0.92."""
    from coordexp.runtime.core.set_figures import iou_matrix

    gt = box(100, 100, 200, 200, "cat")
    a = box(100, 100, 200, 308, "cat")  # IoU with gt 100/208 = 0.48
    b = box(100, 100, 200, 292, "cat")  # IoU with gt 100/192 = 0.52; IoU(a, b) = 192/208 = 0.92
    ious = iou_matrix([a, b], [gt])
    assert ious[0, 0] < 0.5 <= ious[1, 0] and iou_matrix([a], [b])[0, 0] >= 0.9
    assert near_repeats([a, b]) == [False, True]  # the heuristic removes B, the only match
    assert _matches([a], [gt], True) == 0 and _matches([a, b], [gt], True) == 1
    assert certified_duplicates([a, b], [gt]) == [False, False]  # the ground-truth rule keeps it


def test_the_figures_table_of_docs_figures_is_one_table_naming_every_figure():
    """Regression (issue 56, item 15): the EOS paragraph cut the table in two (a reader saw half the figures)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "figures.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    start = lines.index("| figure | meaning |")
    end = next(k for k in range(start, len(lines)) if not lines[k].startswith("|"))
    table = "\n".join(lines[start:end])
    documented = [name for name in FIGURE_NAMES if f"`{name}`" in table]
    assert len(documented) >= len(FIGURE_NAMES) - 1  # rollout_tokens_per_image is described with the counters
    assert "`count_error`" in table and "`backtracks_per_image`" in table


def test_recall_and_premature_eos_by_object_count_bucket():
    """Issue 53: where stage 1 stops early (dense scenes), per bucket of ground-truth objects per image."""
    from coordexp.runtime.core.set_figures import count_bucket_figures

    def scene(n_gt, found, stopped_early):
        gts = [box(10 * k, 0, 10 * k + 9, 9) for k in range(n_gt)]
        return image_figures(gts[:found], gts, eos_stopped=stopped_early)

    images = [scene(3, 3, True), scene(8, 6, True), scene(12, 5, True), scene(12, 12, True), scene(0, 0, True)]
    buckets = count_bucket_figures(images)
    assert buckets["1-6"] == {"images": 1, "objects": 3, "recall": 1.0, "premature_eos_rate": 0.0}
    assert buckets["7-10"] == {"images": 1, "objects": 8, "recall": 6 / 8, "premature_eos_rate": 1.0}
    assert buckets["11+"] == {"images": 2, "objects": 24, "recall": 17 / 24, "premature_eos_rate": 0.5}
    assert aggregate_figures(images)["count_buckets"] == buckets
    assert count_bucket_figures([])["11+"] == {"images": 0, "objects": 0, "recall": None, "premature_eos_rate": None}
