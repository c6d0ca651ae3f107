"""Figures that see the exposure-bias mechanism (docs/design.md, decision 17), as pure functions of predictions.

A prediction matches a ground-truth object at IoU >= 0.5 (boxes), one-to-one, greedily in the order the model wrote
them (each prediction takes the unmatched object it overlaps most): the order matters because the figures ask what
the model wrote *next*. A prediction that overlaps (IoU >= 0.5) an object an earlier prediction already took is a
duplicate. Rank ``r`` is an object's position in the ground truth's reading order (0-based).

The probes (:mod:`coordexp.runtime.toy.probe_run` decodes them) pre-fill the assistant turn with a ground-truth
prefix and let greedy decoding continue:
- ``exposure_gap``: next-object accuracy teacher-forced (prefix = the first r objects; is the next object written
  ground-truth object r?) minus free running (is the free rollout's r-th prediction object r?), at the same rank.
- ``deletion_recovery``: prefix = the objects up to one past a middle object, that object left out; the share of left
  out objects the model writes before EOS (a model that only continues in reading order never returns to it).
- ``duplicate_probe``: prefix whose last object is written twice; the recall of the objects after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from coordexp.runtime.core.matching import aabb_iou_matrix
from coordexp.runtime.core.objects import DetObject

__all__ = ["IOU", "ImageFigures", "GateThresholds", "greedy_match", "image_figures", "aggregate_figures",
           "cell_precision", "gate", "backtracks"]

IOU = 0.5


def greedy_match(preds: Sequence[DetObject], gts: Sequence[DetObject], iou: float = IOU
                 ) -> tuple[list[int | None], list[bool]]:
    """``(gt index matched by each prediction or None, duplicate flag of each prediction)`` (module doc)."""
    return _match(_ious(preds, gts), iou)


def _ious(preds: Sequence[DetObject], gts: Sequence[DetObject]) -> np.ndarray:
    """The (predictions x ground truth) IoU matrix, empty rows or columns included."""
    return aabb_iou_matrix(preds, gts) if preds and gts else np.zeros((len(preds), len(gts)))


def _match(ious: np.ndarray, iou: float) -> tuple[list[int | None], list[bool]]:
    taken: list[int | None] = []
    duplicate: list[bool] = []
    used: set[int] = set()
    for row in ious:
        free = [(v, g) for g, v in enumerate(row) if v >= iou and g not in used]
        if free:
            _, g = max(free)
            used.add(g)
            taken.append(g)
            duplicate.append(False)
        else:
            taken.append(None)
            duplicate.append(bool(len(row)) and bool(np.any(row >= iou)))
    return taken, duplicate


@dataclass(frozen=True)
class ImageFigures:
    """One image's free-running figures."""

    n_pred: int
    n_gt: int
    matched: int
    duplicates: int
    premature_eos: bool  # stopped by EOS while fewer objects were written than the image holds
    rank_hit: tuple[bool, ...]  # per GT rank: matched by some prediction
    next_correct: tuple[bool, ...]  # per GT rank: the r-th prediction matched GT object r
    tokens: int
    backtracks: int = 0  # predictions on an object earlier in reading order than one already written
    backtrack_recoveries: int = 0  # of those, the ones that found an object not yet written (the rest: duplicates)


def backtracks(preds: Sequence[DetObject], gts: Sequence[DetObject], iou: float = IOU) -> tuple[int, int]:
    """``(backtracks, recoveries)``: predictions on (IoU >= ``iou``) a ground-truth object earlier in reading order
    than the furthest object written before them, and of those the ones that take an object not yet taken. A model
    that learned from appended false negatives to go back after its list (the spec's ``Y_train``) backtracks; a
    backtrack that is no recovery is a duplicate."""
    ious = _ious(preds, gts)
    return _backtracks(ious, _match(ious, iou)[0], iou)


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


def image_figures(preds: Sequence[DetObject], gts: Sequence[DetObject], *, eos_stopped: bool, tokens: int = 0
                  ) -> ImageFigures:
    ious = _ious(preds, gts)  # one matrix for the match and the backtracks
    taken, duplicate = _match(ious, IOU)
    hit = [False] * len(gts)
    for g in taken:
        if g is not None:
            hit[g] = True
    next_correct = tuple(r < len(taken) and taken[r] == r for r in range(len(gts)))
    back, recovered = _backtracks(ious, taken, IOU)
    return ImageFigures(n_pred=len(preds), n_gt=len(gts), matched=sum(hit), duplicates=sum(duplicate),
                        premature_eos=bool(eos_stopped) and len(preds) < len(gts), rank_hit=tuple(hit),
                        next_correct=next_correct, tokens=int(tokens), backtracks=back,
                        backtrack_recoveries=recovered)


def _ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den


def aggregate_figures(images: Sequence[ImageFigures]) -> dict[str, object]:
    """``precision``, ``recall``, ``f1`` (micro over objects), ``duplicates_per_image``, ``premature_eos_rate``,
    ``count_error`` (mean |#pred - #gt|), ``recall_by_rank`` (list), ``rollout_tokens_per_image``,
    ``backtracks_per_image`` and ``backtrack_recovery_rate`` (recoveries over backtracks)."""
    n = len(images)
    pred = sum(i.n_pred for i in images)
    gt = sum(i.n_gt for i in images)
    matched = sum(i.matched for i in images)
    precision, recall = _ratio(matched, pred), _ratio(matched, gt)
    f1 = None if precision is None or recall is None else (
        0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall))
    ranks = max((i.n_gt for i in images), default=0)
    by_rank = [_ratio(sum(i.rank_hit[r] for i in images if r < i.n_gt), sum(r < i.n_gt for i in images))
               for r in range(ranks)]
    return {"precision": precision, "recall": recall, "f1": f1,
            "duplicates_per_image": _ratio(sum(i.duplicates for i in images), n),
            "premature_eos_rate": _ratio(sum(i.premature_eos for i in images), n),
            "count_error": _ratio(sum(abs(i.n_pred - i.n_gt) for i in images), n),
            "recall_by_rank": by_rank,
            "rollout_tokens_per_image": _ratio(sum(i.tokens for i in images), n),
            "backtracks_per_image": _ratio(sum(i.backtracks for i in images), n),
            "backtrack_recovery_rate": _ratio(sum(i.backtrack_recoveries for i in images),
                                              sum(i.backtracks for i in images))}


def cell_precision(preds_per_image: Sequence[Sequence[DetObject]], gts_per_image: Sequence[Sequence[DetObject]],
                   cells: int, first_k: int = 3) -> float | None:
    """Share of the first ``first_k`` predictions of every image whose box centre lies in an occupied cell and
    that match (IoU >= 0.5) the box of that cell: did stage 1 learn to see (the gate's perception half)."""
    from coordexp.runtime.toy.grid import cell_of

    good = total = 0
    for preds, gts in zip(preds_per_image, gts_per_image, strict=True):
        owner = {cell_of((g.coords[0] + g.coords[2]) / 2, (g.coords[1] + g.coords[3]) / 2, cells): g for g in gts}
        for p in list(preds)[:first_k]:
            total += 1
            x0, y0, x1, y1 = _aabb(p)
            g = owner.get(cell_of((x0 + x1) / 2, (y0 + y1) / 2, cells))
            good += g is not None and float(aabb_iou_matrix([p], [g])[0, 0]) >= IOU
    return _ratio(good, total)


def _aabb(obj: DetObject) -> tuple[float, float, float, float]:
    xs, ys = obj.coords[0::2], obj.coords[1::2]
    return min(xs), min(ys), max(xs), max(ys)


@dataclass(frozen=True)
class GateThresholds:
    """When the pilot gate passes: perception solved (cell precision) and an exposure gap to close (a TF-free gap
    in next-object accuracy, or premature stops)."""

    cell_precision: float = 0.8
    exposure_gap: float = 0.05
    premature_eos_rate: float = 0.10


@dataclass(frozen=True)
class Gate:
    perception_solved: bool
    exposure_gap_exists: bool
    figures: Mapping[str, object] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.perception_solved and self.exposure_gap_exists

    def to_dict(self) -> dict[str, object]:
        return {"passed": self.passed, "perception_solved": self.perception_solved,
                "exposure_gap_exists": self.exposure_gap_exists, **self.figures}

    def line(self) -> str:
        f = self.figures
        return (f"gate {'PASSED' if self.passed else 'FAILED'}: cell precision of the first objects "
                f"{_pct(f.get('cell_precision'))} (perception {'solved' if self.perception_solved else 'NOT solved'}), "
                f"next-object accuracy teacher-forced {_pct(f.get('next_object_tf'))} vs free "
                f"{_pct(f.get('next_object_free'))} (gap {_pct(f.get('exposure_gap'))}), premature EOS "
                f"{_pct(f.get('premature_eos_rate'))} (exposure gap {'exists' if self.exposure_gap_exists else 'NOT shown'})")


def _pct(value: object) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * float(value):.1f}%"


def gate(figures: Mapping[str, object], thresholds: GateThresholds = GateThresholds()) -> Gate:
    """The pilot gate on stage 1's ``eval`` figures (``cell_precision``, ``exposure_gap``, ``premature_eos_rate``)."""
    cp, gap, eos = (figures.get(k) for k in ("cell_precision", "exposure_gap", "premature_eos_rate"))
    perception = cp is not None and float(cp) >= thresholds.cell_precision
    exposure = (gap is not None and float(gap) >= thresholds.exposure_gap) or (
        eos is not None and float(eos) >= thresholds.premature_eos_rate)
    keys = ("cell_precision", "next_object_tf", "next_object_free", "exposure_gap", "premature_eos_rate",
            "recall_by_rank")
    return Gate(perception, exposure, {k: figures.get(k) for k in keys})
