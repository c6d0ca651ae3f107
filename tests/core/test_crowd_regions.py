"""COCO crowd annotations as ignore regions (issue 55, item 2): ``convert`` keeps them (they were dropped, so a
detection on a crowd region counted as a false positive and the AP was not COCO's), training never sees them, and
evaluation passes them to COCO as ``iscrowd``: the AP equals pycocotools' on the original annotations."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

pycocotools = pytest.importorskip("pycocotools")

from coordexp.runtime.core.coco import CocoImage, ScoredObject, build_coco_gt, coco_results, coco_to_records  # noqa: E402
from coordexp.runtime.core.coco_metrics import evaluate_coco  # noqa: E402
from coordexp.runtime.core.objects import DetObject  # noqa: E402
from coordexp.runtime.model.data import parse_record  # noqa: E402

SIZE = 1000  # a 1000-pixel image: norm1000 bins are pixels, so both evaluations see the same boxes
GT = {
    "images": [{"id": 1, "file_name": "a.jpg", "width": SIZE, "height": SIZE},
               {"id": 2, "file_name": "b.jpg", "width": SIZE, "height": SIZE}],
    "categories": [{"id": 1, "name": "person"}, {"id": 2, "name": "dog"}],
    "annotations": [
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [100, 100, 200, 300], "area": 60000, "iscrowd": 0},
        {"id": 2, "image_id": 1, "category_id": 1, "bbox": [500, 400, 300, 300], "area": 90000, "iscrowd": 1,
         "segmentation": {"counts": [0, 10], "size": [SIZE, SIZE]}},
        {"id": 3, "image_id": 2, "category_id": 2, "bbox": [50, 60, 400, 300], "area": 120000, "iscrowd": 0},
    ],
}
# pixel [x, y, w, h], score: a hit, a detection on the crowd region, a false positive, the dog
DETECTIONS = [(1, 1, [100, 100, 200, 300], 0.9), (1, 1, [520, 420, 250, 250], 0.95), (1, 1, [0, 800, 100, 100], 0.5),
              (2, 2, [50, 60, 400, 300], 0.8)]


def _pycocotools_ap50() -> float:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = json.loads(json.dumps(GT))
        gt.createIndex()
        dt = gt.loadRes([{"image_id": i, "category_id": c, "bbox": b, "score": s} for i, c, b, s in DETECTIONS])
        run = COCOeval(gt, dt, "bbox")
        run.evaluate()
        run.accumulate()
        run.summarize()
    return float(run.stats[1])


def test_crowd_regions_are_kept_and_coco_ap_with_them_equals_pycocotools():
    converted = coco_to_records(GT, source="instances.json", geometry="bbox")
    assert converted.crowd_regions == 1 and "crowd" not in converted.skipped
    first = converted.records[0]
    assert first["crowd"] == [{"desc": "person", "bbox_2d": [500, 400, 800, 700]}]
    assert [o["bbox_2d"] for o in first["objects"]] == [[100, 100, 300, 400]]  # the crowd is no object to train
    records = [parse_record(r, image_root=Path("."), source=f"r{k}", check_files=False)
               for k, r in enumerate(converted.records)]
    assert records[0].crowd[0].coords == (500, 400, 800, 700) and len(records[0].objects) == 1
    images = [CocoImage(k + 1, r.width, r.height, f"{k}.jpg", r.objects, r.crowd) for k, r in enumerate(records)]
    categories = ["dog", "person"]
    names = {1: "person", 2: "dog"}
    scored = [ScoredObject(i, DetObject(names[c], "bbox_2d", (b[0], b[1], b[0] + b[2], b[1] + b[3])), s)
              for i, c, b, s in DETECTIONS]
    results, _ = coco_results(scored, {1: (SIZE, SIZE), 2: (SIZE, SIZE)}, {"dog": 1, "person": 2})
    ours = evaluate_coco(build_coco_gt(images, categories), results, "bbox")["AP50"]
    official = _pycocotools_ap50()
    assert ours == pytest.approx(official, abs=1e-9)
    without_crowd = [CocoImage(im.image_id, im.width, im.height, im.file_name, im.objects) for im in images]
    assert evaluate_coco(build_coco_gt(without_crowd, categories), results, "bbox")["AP50"] < official
