"""COCO AP through the library on hand-made predictions whose AP is known, and results that its own API loads."""

from __future__ import annotations

import json

import pytest

from coordexp.runtime.core.coco import CocoImage, ScoredObject, build_coco_gt, coco_results
from coordexp.runtime.core.coco_metrics import evaluate_coco
from coordexp.runtime.core.objects import DetObject

CATEGORIES = ["circle", "square"]
BOX_A = DetObject("square", "bbox_2d", (100, 100, 400, 400))
BOX_B = DetObject("square", "bbox_2d", (600, 600, 900, 900))
TRI = DetObject("circle", "poly", (500, 100, 900, 100, 700, 400))


def _gt() -> tuple[dict, dict[int, tuple[int, int]]]:
    images = [CocoImage(1, 200, 100, "one.png", (BOX_A, TRI)), CocoImage(2, 120, 120, "two.png", (BOX_B,))]
    return build_coco_gt(images, CATEGORIES), {1: (200, 100), 2: (120, 120)}


def _results(preds: list[ScoredObject]) -> list[dict]:
    gt, sizes = _gt()
    return coco_results(preds, sizes, {c["name"]: c["id"] for c in gt["categories"]})[0]


def test_perfect_predictions_score_one():
    gt, _ = _gt()
    preds = [ScoredObject(1, BOX_A, 0.9), ScoredObject(1, TRI, 0.8), ScoredObject(2, BOX_B, 0.7)]
    for iou_type in ("bbox", "segm"):
        metrics = evaluate_coco(gt, _results(preds), iou_type)
        assert metrics["AP"] == pytest.approx(1.0) and metrics["AP50"] == pytest.approx(1.0)
        assert metrics["AR100"] == pytest.approx(1.0)
        assert metrics.per_category == {"circle": pytest.approx(1.0), "square": pytest.approx(1.0)}


def test_all_wrong_predictions_score_zero():
    gt, _ = _gt()
    wrong_place = DetObject("square", "bbox_2d", (500, 0, 520, 20))
    wrong_class = DetObject("circle", "bbox_2d", BOX_A.coords)
    metrics = evaluate_coco(gt, _results([ScoredObject(1, wrong_place, 0.9), ScoredObject(1, wrong_class, 0.8)]))
    assert metrics["AP"] == 0.0 and metrics["AP50"] == 0.0 and metrics["AR100"] == 0.0


def test_half_recall_is_51_of_101_recall_points():
    """One class, two GT, one found with precision 1: COCO interpolates at 101 recall points 0, 0.01, .., 1, so
    recall points 0..0.5 (51 of them) have precision 1 and the rest 0."""
    gt, _ = _gt()
    metrics = evaluate_coco(gt, _results([ScoredObject(1, BOX_A, 0.9)]))
    assert metrics.per_category["square"] == pytest.approx(51 / 101)
    assert metrics.per_category["circle"] == 0.0
    assert metrics["AP"] == pytest.approx(51 / 101 / 2)


def test_scores_rank_the_predictions():
    """Both squares found plus two misses: misses ranked first halve the precision at every recall."""
    gt, _ = _gt()
    miss = DetObject("square", "bbox_2d", (0, 900, 50, 950))
    hits = [ScoredObject(1, BOX_A, 0.5), ScoredObject(2, BOX_B, 0.4)]
    good = evaluate_coco(gt, _results(hits + [ScoredObject(1, miss, 0.2), ScoredObject(2, miss, 0.1)]))
    bad = evaluate_coco(gt, _results(hits + [ScoredObject(1, miss, 0.9), ScoredObject(2, miss, 0.8)]))
    assert good.per_category["square"] == pytest.approx(1.0)
    assert bad.per_category["square"] == pytest.approx(0.5)


def test_box_predictions_match_polygon_ground_truth_by_box_but_not_by_mask():
    """A triangle predicted as its enclosing box: a perfect box, half a mask (IoU 0.5 -> only AP50 counts it)."""
    gt, _ = _gt()
    box_of_tri = DetObject("circle", "bbox_2d", (500, 100, 900, 400))
    results = _results([ScoredObject(1, box_of_tri, 0.9)])
    assert evaluate_coco(gt, results, "bbox").per_category["circle"] == pytest.approx(1.0)
    segm = evaluate_coco(gt, results, "segm")
    assert segm.per_category["circle"] < 0.2  # IoU is 0.5: only the 0.50 threshold counts it


def test_results_json_loads_in_the_library_api(tmp_path):
    from faster_coco_eval import COCO

    gt, _ = _gt()
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "results.json").write_text(json.dumps(_results([ScoredObject(1, TRI, 0.3)])))
    coco_gt = COCO(str(tmp_path / "gt.json"))
    loaded = coco_gt.loadRes(str(tmp_path / "results.json"))
    assert len(loaded.getAnnIds()) == 1
    assert loaded.loadAnns(loaded.getAnnIds())[0]["category_id"] == coco_gt.getCatIds(catNms=["circle"])[0]


def test_no_predictions_is_zero_ap_not_an_error():
    gt, _ = _gt()
    assert evaluate_coco(gt, [])["AP"] == 0.0
