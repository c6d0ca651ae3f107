"""Did it help on my data? Two ``coordexp eval`` result folders of the same images, compared image by image.

Each folder holds ``coco_gt.json`` (the images and their ground truth, pixels) and ``coco_results.json`` (the
detections, pixels, in the order the model wrote them per image). The figures of B minus A are paired by image, and
their spread is a percentile bootstrap over images: the same resampled images for both models, so what varies is
which images a user happened to hold, not the models. AP50 is COCO's (the library, on the resampled set with
distinct image ids); precision, recall and F1 are the set figures at box IoU 0.5, class-aware, greedy in written
order (:mod:`coordexp.runtime.core.set_figures`). The noise floor says what one object is worth: with 31 ground-truth
objects, one true positive more or less moves recall by 3.2 points.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from coordexp.runtime.core.coco_metrics import evaluate_coco
from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.set_figures import image_figures

__all__ = ["EvalFolder", "CompareError", "read_eval_folder", "compare_eval_folders", "COMPARED"]

COMPARED = ("AP50", "f1", "precision", "recall")


class CompareError(ValueError):
    """Two folders that cannot be compared (another image set, a missing or unreadable file)."""


@dataclass(frozen=True)
class EvalFolder:
    """One evaluation: per image (in the folder's order) its file name, size, ground-truth annotations and
    detections as COCO dicts, and the category names by id."""

    names: tuple[str, ...]
    sizes: tuple[tuple[int, int], ...]
    gt: tuple[tuple[dict[str, Any], ...], ...]
    detections: tuple[tuple[dict[str, Any], ...], ...]
    categories: dict[int, str]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CompareError(f"{path} is missing: pass a folder `coordexp eval` wrote (eval_val, ...)") from None
    except (OSError, ValueError) as exc:
        raise CompareError(f"{path} cannot be read ({exc})") from None


def read_eval_folder(folder: str | Path) -> EvalFolder:
    """The images, ground truth and detections of an ``eval`` result folder."""
    root = Path(folder)
    gt, results = _read_json(root / "coco_gt.json"), _read_json(root / "coco_results.json")
    try:
        images = [(int(im["id"]), str(im["file_name"]), (int(im["width"]), int(im["height"]))) for im in gt["images"]]
        categories = {int(c["id"]): str(c["name"]) for c in gt["categories"]}
        by_image: dict[int, list[dict[str, Any]]] = {iid: [] for iid, _, _ in images}
        for ann in gt["annotations"]:
            by_image[int(ann["image_id"])].append(ann)
        found: dict[int, list[dict[str, Any]]] = {iid: [] for iid, _, _ in images}
        for det in results:
            found[int(det["image_id"])].append(det)
    except (KeyError, TypeError, ValueError) as exc:
        raise CompareError(f"{root}: coco_gt.json or coco_results.json is not what `coordexp eval` writes ({exc!r})"
                           ) from None
    return EvalFolder(names=tuple(n for _, n, _ in images), sizes=tuple(s for _, _, s in images),
                      gt=tuple(tuple(by_image[i]) for i, _, _ in images),
                      detections=tuple(tuple(found[i]) for i, _, _ in images), categories=categories)


def _box(entry: dict[str, Any], categories: dict[int, str]) -> DetObject:
    x, y, w, h = (float(v) for v in entry["bbox"])
    return DetObject(categories[int(entry["category_id"])], "bbox_2d", (x, y, x + w, y + h))


def _counts(folder: EvalFolder) -> np.ndarray:
    """Per image: [class-aware matches, predictions, ground-truth objects] (crowd regions are no objects)."""
    rows = []
    for gt, found in zip(folder.gt, folder.detections):
        objects = [_box(a, folder.categories) for a in gt if not a.get("iscrowd")]
        figures = image_figures([_box(d, folder.categories) for d in found], objects, eos_stopped=True)
        rows.append((figures.matched_class, figures.n_pred, figures.n_gt))
    return np.array(rows, dtype=np.float64).reshape(-1, 3)


def _set_figures(counts: np.ndarray) -> dict[str, float | None]:
    matched, pred, gt = counts.sum(axis=0)
    precision = matched / pred if pred else None
    recall = matched / gt if gt else None
    f1 = None if precision is None or recall is None else (
        0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall))
    return {"precision": precision, "recall": recall, "f1": f1}


def _ap50(folder: EvalFolder, picks: Sequence[int]) -> float | None:
    """COCO AP50 of the images ``picks`` (repeats allowed: each copy is an image of its own)."""
    images, annotations, results = [], [], []
    for new_id, k in enumerate(picks, start=1):
        width, height = folder.sizes[k]
        images.append({"id": new_id, "width": width, "height": height, "file_name": f"{new_id}.png"})
        for ann in folder.gt[k]:
            annotations.append({**ann, "id": len(annotations) + 1, "image_id": new_id})
        results.extend({**det, "image_id": new_id} for det in folder.detections[k])
    gt = {"images": images, "annotations": annotations,
          "categories": [{"id": i, "name": n} for i, n in sorted(folder.categories.items())]}
    return evaluate_coco(gt, results, "bbox")["AP50"]


def _interval(values: list[float]) -> list[float] | None:
    kept = [v for v in values if v is not None and np.isfinite(v)]
    if len(kept) < 2:
        return None
    return [float(np.percentile(kept, 2.5)), float(np.percentile(kept, 97.5))]


def compare_eval_folders(a: EvalFolder, b: EvalFolder, *, bootstrap: int = 1000, ap_bootstrap: int = 200,
                         seed: int = 0) -> dict[str, Any]:
    """B minus A on the same images: each figure's two values, the difference and its 95% percentile-bootstrap
    interval over images (``ap_bootstrap`` replicates for AP50, a COCO evaluation each; ``bootstrap`` for the set
    figures), and the noise floor. Raises :class:`CompareError` when the folders hold other images."""
    if a.names != b.names or a.sizes != b.sizes:
        only_a, only_b = sorted(set(a.names) - set(b.names)), sorted(set(b.names) - set(a.names))
        detail = (f"{len(only_a)} image(s) only in A (e.g. {only_a[0]}), {len(only_b)} only in B"
                  if only_a or only_b else "the same files in another order or at other sizes")
        raise CompareError(f"the two evaluations are not of the same images ({detail}); evaluate both models on "
                           "the same split with the same --limit")
    if a.gt != b.gt:
        raise CompareError("the two evaluations hold other ground truth for the same images; evaluate both with the "
                           "same data file")
    n = len(a.names)
    if n == 0:
        raise CompareError("the evaluations hold no image")
    counts_a, counts_b = _counts(a), _counts(b)
    every = list(range(n))
    values = {"A": {**_set_figures(counts_a), "AP50": _ap50(a, every)},
              "B": {**_set_figures(counts_b), "AP50": _ap50(b, every)}}
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {k: [] for k in COMPARED}
    for replicate in range(max(bootstrap, ap_bootstrap)):
        picks = rng.integers(0, n, size=n)
        if replicate < bootstrap:
            fa, fb = _set_figures(counts_a[picks]), _set_figures(counts_b[picks])
            for key in ("f1", "precision", "recall"):
                if fa[key] is not None and fb[key] is not None:
                    draws[key].append(fb[key] - fa[key])
        if replicate < ap_bootstrap:
            ap_a, ap_b = _ap50(a, picks.tolist()), _ap50(b, picks.tolist())
            if ap_a is not None and ap_b is not None:
                draws["AP50"].append(ap_b - ap_a)
    gt_objects = int(counts_a[:, 2].sum())
    figures = {}
    for key in COMPARED:
        va, vb = values["A"][key], values["B"][key]
        figures[key] = {"A": va, "B": vb, "difference": None if va is None or vb is None else vb - va,
                        "ci95": _interval(draws[key])}
    return {"images": n, "gt_objects": gt_objects, "bootstrap": bootstrap, "ap_bootstrap": ap_bootstrap,
            "seed": seed, "figures": figures,
            "one_object_points": None if gt_objects == 0 else 100.0 / gt_objects}
