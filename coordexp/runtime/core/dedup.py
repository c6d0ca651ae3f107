"""What removing repeats buys, with no training (docs/design.md, decision 18; docs/figures.md).

A repeat written by greedy decoding scores about as high as a true positive under the log-probability ranking, so
each one costs AP. These functions evaluate the same predictions several ways, beside each other:

- ``raw``: as written;
- ``label_free``: near repeats removed (same desc and IoU >= 0.9 with an earlier kept prediction; a heuristic that
  can remove a true positive): what ``coordexp eval --dedup`` and ``/detect/``'s ``dedup`` option do at decoding;
- ``oracle`` (the key kept for the committed results; read it as "the ground-truth rule"): every certified
  duplicate removed (IoU >= 0.5 with an object an earlier prediction took included). It is no bound on AP: COCO
  matches in score order, not written order, so removing a certified duplicate can drop AP50 (1.000 -> 0.505 when
  the duplicate outscored the true positive it repeats, which then takes the object);
- ``oracle_lowest``: the same duplicates kept but moved below every other prediction of the set (is it their
  presence or their rank that costs AP?).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from coordexp.runtime.core.coco import CocoImage, ScoredObject, build_coco_gt, coco_results
from coordexp.runtime.core.coco_metrics import evaluate_coco
from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.set_figures import aggregate_figures, certified_duplicates, image_figures, near_repeats

__all__ = ["ScoredImage", "DEDUP_MODES", "DEDUP_SET_FIGURES", "dedup_figures"]

DEDUP_MODES = ("raw", "label_free", "oracle", "oracle_lowest")
# the set figures of the predictions kept, beside box AP: an early stop is judged on what is left (a removed repeat
# can make an image hold fewer predictions than objects), by object count too
DEDUP_SET_FIGURES = ("precision", "recall", "f1", "duplicates_per_image", "premature_eos_rate", "count_buckets")


@dataclass(frozen=True)
class ScoredImage:
    """One evaluated image: its size, ground truth, and predictions in written order with their scores."""

    width: int
    height: int
    gt: tuple[DetObject, ...]
    predictions: tuple[DetObject, ...]
    scores: tuple[float, ...]
    eos_stopped: bool = True


def _evaluate(images: Sequence[ScoredImage], keep: Sequence[Sequence[bool]], lowest: Sequence[Sequence[bool]]
              ) -> dict[str, Any]:
    coco_images = [CocoImage(k + 1, im.width, im.height, f"{k + 1}.png", im.gt) for k, im in enumerate(images)]
    categories = sorted({o.desc for im in images for o in im.gt})
    floor = min((s for im in images for s in im.scores), default=1.0)
    scored = [ScoredObject(k + 1, p, (floor * 1e-6 * (1.0 + s) if low else s))
              for k, (im, kept, lows) in enumerate(zip(images, keep, lowest))
              for p, s, ok, low in zip(im.predictions, im.scores, kept, lows) if ok]
    sizes = {k + 1: (im.width, im.height) for k, im in enumerate(images)}
    results, _ = coco_results(scored, sizes, {name: k + 1 for k, name in enumerate(categories)})
    boxes = evaluate_coco(build_coco_gt(coco_images, categories), results, "bbox")
    figures = aggregate_figures([image_figures([p for p, ok in zip(im.predictions, kept) if ok], im.gt,
                                               eos_stopped=im.eos_stopped) for im, kept in zip(images, keep)])
    removed = sum(len(k) - sum(k) for k in keep)
    return {"AP": boxes["AP"], "AP50": boxes["AP50"], **{k: figures[k] for k in DEDUP_SET_FIGURES},
            "removed": removed}


def dedup_figures(images: Sequence[ScoredImage], modes: Sequence[str] = DEDUP_MODES) -> dict[str, dict[str, Any]]:
    """Box AP, AP50 and the :data:`DEDUP_SET_FIGURES` of ``images`` under each of ``modes``."""
    unknown = [m for m in modes if m not in DEDUP_MODES]
    if unknown:
        raise ValueError(f"unknown dedup modes {unknown}; choose from {list(DEDUP_MODES)}")
    everything = [[True] * len(im.predictions) for im in images]
    nothing = [[False] * len(im.predictions) for im in images]
    free = [[not d for d in near_repeats(list(im.predictions))] for im in images]
    oracle = [[not d for d in certified_duplicates(list(im.predictions), list(im.gt))] for im in images]
    plans = {"raw": (everything, nothing), "label_free": (free, nothing), "oracle": (oracle, nothing),
             "oracle_lowest": (everything, [[not k for k in keep] for keep in oracle])}
    return {mode: _evaluate(images, *plans[mode]) for mode in modes}
