"""Set-level detection figures of free-running predictions, for any dataset (docs/figures.md says what each means).

COCO AP ranks predictions by score; these figures judge the set the model wrote, in the order it wrote it, which is
what a rollout-trained detector changes (more objects found, more repeats, earlier stops).

A prediction matches a ground-truth object at box IoU >= 0.5 (polygons by their boxes), one-to-one, greedily in
the order the model wrote them: each prediction takes the unmatched object it overlaps most. Class-aware figures
also require the same ``desc``; the ``*_any_class`` figures do not (the stage-2 matcher is geometry-only, as the
spec says, so its match rate is class-agnostic).

A **certified duplicate** is a prediction whose removal can never cost a true positive under those rules (label
safe): one that matches no object (with or without its class) and either has the same desc and IoU >= 0.9 with an
earlier prediction that is not itself a certified duplicate, or overlaps (IoU >= 0.5) an object an earlier
prediction took. It needs the ground truth. Without it (at decoding) only the first rule can be checked, and then
it is a heuristic, a **near repeat** (:func:`near_repeats`): removing one can cost a true positive (A written first
at IoU 0.48 with an object, B at 0.52, IoU(A, B) 0.92: B is removed and the object is lost). Rank ``r`` is an
object's position in the ground truth's reading order (0-based).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from coordexp.runtime.core.matching import aabb_iou_matrix
from coordexp.runtime.core.objects import DetObject

__all__ = ["IOU", "DUPLICATE_IOU", "ImageFigures", "iou_matrix", "greedy_match", "certified_duplicates", "near_repeats",
           "backtracks", "image_figures", "aggregate_figures", "FIGURE_NAMES",
           "COUNT_BUCKETS", "count_bucket_figures"]

IOU = 0.5
DUPLICATE_IOU = 0.9
# The scalar figures aggregate_figures returns (recall_by_rank, a list, beside them), in table order.
FIGURE_NAMES: tuple[str, ...] = (
    "precision", "recall", "f1", "precision_any_class", "recall_any_class", "f1_any_class", "pred_per_gt",
    "duplicates_per_image", "premature_eos_rate", "cut_off_rate", "count_error", "rollout_tokens_per_image",
    "backtracks_per_image", "backtrack_recovery_rate",
)


def iou_matrix(preds: Sequence[DetObject], gts: Sequence[DetObject]) -> np.ndarray:
    """The (predictions x ground truth) box-IoU matrix, empty rows or columns included."""
    return aabb_iou_matrix(preds, gts) if len(preds) and len(gts) else np.zeros((len(preds), len(gts)))


def _same_class(preds: Sequence[DetObject], gts: Sequence[DetObject]) -> np.ndarray:
    return np.array([[p.desc == g.desc for g in gts] for p in preds], dtype=bool).reshape(len(preds), len(gts))


def _match(ious: np.ndarray, iou: float) -> tuple[list[int | None], list[bool]]:
    """Greedy in row order: each row takes its best free column at >= ``iou``; an unmatched row overlapping a taken
    column at >= ``iou`` is flagged (every such column was taken earlier, else the row would have matched it)."""
    taken: list[int | None] = []
    flagged: list[bool] = []
    used: set[int] = set()
    for row in ious:
        free = [(v, g) for g, v in enumerate(row) if v >= iou and g not in used]
        if free:
            _, g = max(free)
            used.add(g)
            taken.append(g)
            flagged.append(False)
        else:
            taken.append(None)
            flagged.append(bool(len(row)) and bool(np.any(row >= iou)))
    return taken, flagged


def greedy_match(preds: Sequence[DetObject], gts: Sequence[DetObject], iou: float = IOU, *,
                 class_aware: bool = False) -> tuple[list[int | None], list[bool]]:
    """``(gt index matched by each prediction or None, flag of each unmatched prediction that overlaps an object an
    earlier prediction took)``; ``class_aware`` also requires equal descs."""
    ious = iou_matrix(preds, gts)
    if class_aware:
        ious = np.where(_same_class(preds, gts), ious, 0.0)
    return _match(ious, iou)


def _certified(preds: Sequence[DetObject], self_ious: np.ndarray, repeats_gt: Sequence[bool],
               matched: Sequence[bool]) -> list[bool]:
    out: list[bool] = []
    for k, pred in enumerate(preds):
        earlier = any(not out[j] and preds[j].desc == pred.desc and self_ious[k, j] >= DUPLICATE_IOU
                      for j in range(k))
        out.append(not matched[k] and (earlier or bool(repeats_gt[k])))
    return out


def near_repeats(preds: Sequence[DetObject]) -> list[bool]:
    """Per prediction: is it a near repeat (same desc, IoU >= 0.9 with an earlier kept prediction)? The label-free
    heuristic ``eval --dedup`` and ``/detect/``'s ``dedup`` apply; unlike a certified duplicate it can be the only
    true positive of its object (module doc)."""
    return _certified(preds, iou_matrix(preds, preds), [False] * len(preds), [False] * len(preds))


def certified_duplicates(preds: Sequence[DetObject], gts: Sequence[DetObject]) -> list[bool]:
    """Per prediction: is it a certified duplicate (module doc)? A prediction that matches an object is never one
    (removing it would cost a true positive); without labels use :func:`near_repeats`, a heuristic."""
    ious = iou_matrix(preds, gts)
    taken, repeats_gt = _match(ious, IOU)
    taken_class, _ = _match(np.where(_same_class(preds, gts), ious, 0.0), IOU)
    return _certified(preds, iou_matrix(preds, preds), repeats_gt, _either(taken, taken_class))


def _either(taken: Sequence[int | None], taken_class: Sequence[int | None]) -> list[bool]:
    return [a is not None or b is not None for a, b in zip(taken, taken_class)]


def _backtracks(ious: np.ndarray, taken: Sequence[int | None], iou: float) -> tuple[int, int]:
    furthest, back, recovered = -1, 0, 0
    for row, g in zip(ious, taken):
        rank = g if g is not None else (int(np.argmax(row)) if len(row) and float(row.max()) >= iou else None)
        if rank is None:
            continue
        if rank < furthest:
            back += 1
            recovered += g is not None
        furthest = max(furthest, rank)
    return back, recovered


def backtracks(preds: Sequence[DetObject], gts: Sequence[DetObject], iou: float = IOU) -> tuple[int, int]:
    """``(backtracks, recoveries)``: predictions on (IoU >= ``iou``) a ground-truth object earlier in reading order
    than the furthest object written before them, and of those the ones that take an object not yet taken. A model
    that learned from appended false negatives to go back after its list backtracks; a backtrack that is no recovery
    is a duplicate."""
    ious = iou_matrix(preds, gts)
    return _backtracks(ious, _match(ious, iou)[0], iou)


@dataclass(frozen=True)
class ImageFigures:
    """One image's free-running figures (counts; :func:`aggregate_figures` turns a set of them into rates)."""

    n_pred: int
    n_gt: int
    matched: int  # class-agnostic matches at IoU 0.5
    duplicates: int  # certified duplicates
    premature_eos: bool  # stopped by EOS while fewer objects were written than the image holds
    rank_hit: tuple[bool, ...]  # per GT rank: matched (class-aware) by some prediction
    next_correct: tuple[bool, ...]  # per GT rank: the r-th prediction matched GT object r (class-agnostic)
    tokens: int
    backtracks: int = 0  # predictions on an object earlier in reading order than one already written
    backtrack_recoveries: int = 0  # of those, the ones that found an object not yet written (the rest: duplicates)
    matched_class: int = 0  # class-aware matches at IoU 0.5
    cut_off: bool = False  # the rollout ended without EOS (the length limit or the repeat guard stopped it)


def image_figures(preds: Sequence[DetObject], gts: Sequence[DetObject], *, eos_stopped: bool, tokens: int = 0,
                  cut_off: bool = False) -> ImageFigures:
    """The figures of one image's predictions (in written order) against its ground truth (in reading order)."""
    ious = iou_matrix(preds, gts)
    taken, repeats_gt = _match(ious, IOU)
    taken_class, _ = _match(np.where(_same_class(preds, gts), ious, 0.0), IOU)
    hit = [False] * len(gts)
    for g in taken_class:
        if g is not None:
            hit[g] = True
    next_correct = tuple(r < len(taken) and taken[r] == r for r in range(len(gts)))
    back, recovered = _backtracks(ious, taken, IOU)
    duplicates = _certified(preds, iou_matrix(preds, preds), repeats_gt, _either(taken, taken_class))
    return ImageFigures(n_pred=len(preds), n_gt=len(gts), matched=sum(g is not None for g in taken),
                        duplicates=sum(duplicates), premature_eos=bool(eos_stopped) and len(preds) < len(gts),
                        rank_hit=tuple(hit), next_correct=next_correct, tokens=int(tokens), backtracks=back,
                        backtrack_recoveries=recovered, matched_class=sum(hit), cut_off=bool(cut_off))


def _ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den


def _f1(precision: float | None, recall: float | None) -> float | None:
    if precision is None or recall is None:
        return None
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def aggregate_figures(images: Sequence[ImageFigures]) -> dict[str, object]:
    """Fractions over a set of images (micro over objects; ``None`` where undefined): the :data:`FIGURE_NAMES`
    and ``recall_by_rank`` (class-aware recall of the objects at each reading-order rank)."""
    n = len(images)
    pred = sum(i.n_pred for i in images)
    gt = sum(i.n_gt for i in images)
    precision, recall = _ratio(sum(i.matched_class for i in images), pred), _ratio(sum(i.matched_class for i in images), gt)
    any_precision, any_recall = _ratio(sum(i.matched for i in images), pred), _ratio(sum(i.matched for i in images), gt)
    ranks = max((i.n_gt for i in images), default=0)
    by_rank = [_ratio(sum(i.rank_hit[r] for i in images if r < i.n_gt), sum(r < i.n_gt for i in images))
               for r in range(ranks)]
    return {"precision": precision, "recall": recall, "f1": _f1(precision, recall),
            "precision_any_class": any_precision, "recall_any_class": any_recall,
            "f1_any_class": _f1(any_precision, any_recall),
            "pred_per_gt": _ratio(pred, gt),
            "duplicates_per_image": _ratio(sum(i.duplicates for i in images), n),
            "premature_eos_rate": _ratio(sum(i.premature_eos for i in images), n),
            "cut_off_rate": _ratio(sum(i.cut_off for i in images), n),
            "count_error": _ratio(sum(abs(i.n_pred - i.n_gt) for i in images), n),
            "recall_by_rank": by_rank,
            "rollout_tokens_per_image": _ratio(sum(i.tokens for i in images), n),
            "backtracks_per_image": _ratio(sum(i.backtracks for i in images), n),
            "backtrack_recovery_rate": _ratio(sum(i.backtrack_recoveries for i in images),
                                              sum(i.backtracks for i in images)),
            "count_buckets": count_bucket_figures(images)}


COUNT_BUCKETS: tuple[tuple[str, int, int | None], ...] = (("1-6", 1, 6), ("7-10", 7, 10), ("11+", 11, None))
"""Ground-truth objects per image: where stage 1 stops early on dense scenes (the upstream project measured premature
stops dominating scenes of 7+ and 11+ objects)."""


def count_bucket_figures(images: Sequence[ImageFigures]) -> dict[str, dict[str, object]]:
    """Per :data:`COUNT_BUCKETS` bucket of ground-truth objects per image: its images and objects, class-aware recall
    and premature-EOS rate (``None`` where the bucket is empty); images without ground truth are in none."""
    out: dict[str, dict[str, object]] = {}
    for name, low, high in COUNT_BUCKETS:
        chosen = [i for i in images if i.n_gt >= low and (high is None or i.n_gt <= high)]
        objects = sum(i.n_gt for i in chosen)
        out[name] = {"images": len(chosen), "objects": objects,
                     "recall": _ratio(sum(i.matched_class for i in chosen), objects),
                     "premature_eos_rate": _ratio(sum(i.premature_eos for i in chosen), len(chosen))}
    return out
