"""The zero-training bound (coordexp/runtime/core/dedup.py) on hand-built images: a repeat of a found object costs
precision and AP; removing it (label-free or oracle) or ranking it last gives them back."""

from __future__ import annotations

import pytest

from coordexp.runtime.core.dedup import ScoredImage, dedup_figures
from coordexp.runtime.core.objects import DetObject


def box(x, desc="box"):
    return DetObject(desc, "bbox_2d", (x, 100, x + 100, 200))


def test_repeats_removed_or_ranked_last():
    gt = (box(0), box(300), box(600))
    # image 1: all three found, object 0 repeated with a high score; image 2: a missed object, no repeat
    one = ScoredImage(1000, 1000, gt, (box(0), box(2), box(300), box(600)), (0.9, 0.95, 0.5, 0.4))
    two = ScoredImage(1000, 1000, gt, (box(0), box(300)), (0.8, 0.3))
    f = dedup_figures([one, two])
    assert f["raw"]["removed"] == 0 and f["raw"]["precision"] == pytest.approx(5 / 6)
    assert f["label_free"]["removed"] == 1 and f["oracle"]["removed"] == 1  # IoU(box(0), box(2)) >= 0.9
    for mode in ("label_free", "oracle"):
        assert f[mode]["precision"] == 1.0 and f[mode]["recall"] == pytest.approx(5 / 6)
        assert f[mode]["AP50"] > f["raw"]["AP50"]
    assert f["oracle_lowest"]["removed"] == 0 and f["oracle_lowest"]["AP50"] == pytest.approx(f["oracle"]["AP50"])
    # another desc on a found object's place: only the ground-truth rule can call it a repeat
    three = ScoredImage(1000, 1000, gt, (box(0), box(2, "other"), box(300), box(600)), (0.9, 0.95, 0.5, 0.4))
    g = dedup_figures([three], ("label_free", "oracle"))
    assert (g["label_free"]["removed"], g["oracle"]["removed"]) == (0, 1)
    with pytest.raises(ValueError, match="unknown dedup modes"):
        dedup_figures([one], ("nope",))


def test_the_ground_truth_rule_is_no_bound_on_ap_under_score_order_matching():
    """Regression (issue 56, item 9): the 'oracle' column was read as a bound on any duplicate fix; COCO matches in
    score order, so a certified duplicate (written after the true positive, scored above it) takes the object in AP,
    and removing it leaves the true positive ranked below another image's false positive."""
    gt = DetObject("box", "bbox_2d", (100, 100, 200, 200))
    first = DetObject("box", "bbox_2d", (100, 100, 200, 200))  # the true positive, written first, scored low
    repeat = DetObject("box", "bbox_2d", (100, 100, 200, 260))  # IoU 0.625 with the object the first one took
    one = ScoredImage(1000, 1000, (gt,), (first, repeat), (0.5, 0.9))
    two = ScoredImage(1000, 1000, (), (DetObject("box", "bbox_2d", (0, 0, 50, 50)),), (0.7,))
    f = dedup_figures([one, two], ("raw", "oracle"))
    assert f["oracle"]["removed"] == 1
    assert f["raw"]["AP50"] == pytest.approx(1.0) and f["oracle"]["AP50"] < 0.6  # removal cost AP50
    from coordexp.runtime.core import dedup

    assert "no bound on AP" in " ".join(dedup.__doc__.split())  # the docs say so instead of calling it a bound


def test_the_figures_after_removal_judge_early_stops_on_the_predictions_kept():
    """Issue 53: a decoding choice reports premature EOS and recall per object count after near repeats are removed
    (the predictions a user keeps): an image whose only extra prediction was a near repeat now holds fewer
    predictions than objects."""
    gt = (box(0), box(300), box(600))
    image = ScoredImage(1000, 1000, gt, (box(0), box(2), box(300)), (0.9, 0.8, 0.7), eos_stopped=True)
    f = dedup_figures([image], ("raw", "label_free"))
    assert f["raw"]["premature_eos_rate"] == 0.0 and f["label_free"]["premature_eos_rate"] == 1.0
    assert f["label_free"]["count_buckets"]["1-6"] == {"images": 1, "objects": 3, "recall": pytest.approx(2 / 3),
                                                       "premature_eos_rate": 1.0}
    assert f["label_free"]["count_buckets"]["11+"]["recall"] is None
