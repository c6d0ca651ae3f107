"""COCO detection metrics through faster-coco-eval (the AP arithmetic is the library's, never ours).

faster-coco-eval was chosen over pycocotools: the same numbers (checked on 500 images: identical stats), about
10x faster for boxes and 3x for masks on our CPU, actively released. Metrics that COCO leaves undefined (no ground
truth in a size bucket or a category) are ``None`` here, not COCO's ``-1``.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Sequence

import numpy as np

from coordexp.errors import ExternalSystemError

__all__ = ["IouType", "CocoMetrics", "evaluate_coco", "SUMMARY_KEYS"]

IouType = Literal["bbox", "segm"]
# COCOeval.stats order (the 12 standard figures).
SUMMARY_KEYS: tuple[str, ...] = (
    "AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large", "AR1", "AR10", "AR100", "AR_small", "AR_medium",
    "AR_large",
)


@dataclass(frozen=True)
class CocoMetrics:
    """The standard COCO figures (fractions in 0..1, ``None`` where undefined) plus per-category AP."""

    iou_type: IouType
    summary: Mapping[str, Optional[float]]
    per_category: Mapping[str, Optional[float]] = field(default_factory=dict)
    n_images: int = 0
    n_ground_truth: int = 0
    n_predictions: int = 0

    def __getitem__(self, key: str) -> Optional[float]:
        return self.summary[key]

    def to_dict(self) -> dict[str, Any]:
        return {"iou_type": self.iou_type, **dict(self.summary), "per_category": dict(self.per_category),
                "images": self.n_images, "ground_truth": self.n_ground_truth, "predictions": self.n_predictions}


def _defined(value: float) -> Optional[float]:
    return None if value < 0 else float(value)


def _library() -> tuple[Any, Any]:
    try:
        from faster_coco_eval import COCO, COCOeval_faster
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ExternalSystemError(
            f"COCO evaluation needs faster-coco-eval ({exc})", hint="pip install 'faster-coco-eval>=1.6'"
        ) from exc
    return COCO, COCOeval_faster


def evaluate_coco(gt: Mapping[str, Any], results: Sequence[Mapping[str, Any]], iou_type: IouType = "bbox") -> CocoMetrics:
    """COCO metrics of ``results`` (a results list) against ``gt`` (an instances dict); inputs are not mutated."""
    import copy

    COCO, COCOeval = _library()
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        coco_gt = COCO(copy.deepcopy(dict(gt)))
        coco_dt = coco_gt.loadRes(copy.deepcopy(list(results)))
        evaluator = COCOeval(coco_gt, coco_dt, iou_type)
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats = np.asarray(evaluator.stats, dtype=np.float64)[: len(SUMMARY_KEYS)]
    summary = {key: _defined(v) for key, v in zip(SUMMARY_KEYS, stats)}
    # precision: [iou thresholds, recall points, categories, area ranges, max dets]; area "all", maxDets 100
    precision = np.asarray(evaluator.eval["precision"])
    names = {c["id"]: c["name"] for c in gt.get("categories", [])}
    per_category: dict[str, Optional[float]] = {}
    for k, cat_id in enumerate(evaluator.params.catIds):
        values = precision[:, :, k, 0, -1]
        values = values[values > -1]
        per_category[names.get(cat_id, str(cat_id))] = float(values.mean()) if values.size else None
    return CocoMetrics(
        iou_type=iou_type, summary=summary, per_category=per_category, n_images=len(gt.get("images", [])),
        n_ground_truth=len(gt.get("annotations", [])), n_predictions=len(results),
    )
