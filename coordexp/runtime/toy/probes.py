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
from coordexp.runtime.core.set_figures import (IOU, ImageFigures, aggregate_figures, backtracks, greedy_match,
                                               image_figures)

__all__ = ["IOU", "ImageFigures", "GateThresholds", "greedy_match", "image_figures", "aggregate_figures",
           "cell_precision", "gate", "backtracks"]


def _ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den


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
