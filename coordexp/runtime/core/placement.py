"""Where ``Y_train`` teaches a missed object, and what it does with a certified repeat (docs/design.md, decision 18).

The spec's target keeps the rollout prefix and appends every missed ground-truth object after it. Three changes:

- ``fn_placement: reading_order``: each missed object is spliced in before the first matched entry whose object
  comes after it in reading order (at the end when none does); the prefix stays token-identical up to the first
  splice point and everything after it is serialized canonically (keys renumbered): matched entries keep their own
  coordinates, pulled toward their targets as in the prefix, other valid entries stay neutral context, invalid
  entries are left out.
- ``fn_placement: cut_at_skip``: the prefix ends before the first matched entry written past a skipped object (a
  ground-truth object earlier in reading order that no earlier entry took), and every object the kept prefix did not
  take follows in reading order: roll in with the model, roll out with the ground truth.
- ``repeats: drop``: certified repeats (:mod:`coordexp.runtime.core.set_figures`; never an entry the matcher
  paired) are left out of the target: the prefix ends before the first one and the rest is serialized as above.
  ``repeats: unlikelihood`` plans the same target and says where each repeat stood (``TargetPlan.repeats_at``), for
  the negative at its first divergent token (:mod:`coordexp.runtime.core.unlikelihood`); a repeat written after the
  last match, which ``trailing_unmatched: drop`` cuts, stands where the list goes on (before the appended objects).

Both refuse nothing at run time: a rollout with no skip, no missed object before the end and no repeat keeps the
spec's target exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import numpy as np

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.set_figures import certified_duplicates
from coordexp.runtime.core.targets import TailEntry

__all__ = ["FnPlacement", "RepeatTreatment", "TargetPlan", "plan_target", "first_skip"]

FnPlacement = Literal["append", "reading_order", "cut_at_skip"]
RepeatTreatment = Literal["neutral", "drop", "unlikelihood"]


@dataclass(frozen=True)
class TargetPlan:
    """What ``build_train_target`` receives: keep the first ``kept`` parsed entries verbatim, the pairs among them,
    and the tail (None: the spec's append of every missed object)."""

    kept: int
    prefix_pairs: tuple[tuple[int, int], ...]  # (position in parse.objects, gt index)
    tail: tuple[TailEntry, ...] | None
    repeats_removed: int = 0
    repeats_at: tuple[tuple[int, DetObject], ...] = ()  # (tail entries before it, the repeat) of each removed one


def first_skip(pairs: Sequence[tuple[int, int]]) -> int | None:
    """The parse position of the first matched entry whose object comes after one no earlier entry took, in
    reading order (ground-truth index order); None when the rollout never skips. ``pairs`` are (position, gt)."""
    taken: set[int] = set()
    for position, g in sorted(pairs):
        if any(k not in taken for k in range(g)):
            return position
        taken.add(g)
    return None


def plan_target(entries_valid: Sequence[bool], preds: Sequence[DetObject], valid_positions: Sequence[int],
                gts: Sequence[DetObject], pairs: Sequence[tuple[int, int]],
                pair_targets: Mapping[tuple[int, int], np.ndarray], *, placement: FnPlacement = "append",
                repeats: RepeatTreatment = "neutral", trailing: Literal["keep", "drop"] = "keep",
                duplicates: Sequence[bool] | None = None) -> TargetPlan:
    """The target plan of one rollout. ``entries_valid`` flags every parsed entry, ``preds`` are the valid ones at
    ``valid_positions``; ``pairs`` are the matcher's (prediction index, gt index) and ``pair_targets`` their coord
    targets keyed the same way; ``trailing`` is ``rollout_matching.trailing_unmatched``; ``duplicates`` the
    predictions' certified-duplicate flags when the caller has them (computed here otherwise)."""
    n_entries = len(entries_valid)
    pred_at = {pos: p for p, pos in enumerate(valid_positions)}  # parse position -> prediction index
    by_position = {valid_positions[p]: (p, g) for p, g in pairs}
    parse_pairs = sorted((valid_positions[p], g) for p, g in pairs)
    limit = max((pos + 1 for pos, _ in parse_pairs), default=0) if trailing == "drop" else n_entries
    matched_preds = {p for p, _ in pairs}
    repeat_at: set[int] = set()
    if repeats != "neutral":
        flags = certified_duplicates(preds, gts) if duplicates is None else duplicates
        repeat_at = {valid_positions[p] for p, dup in enumerate(flags) if dup and p not in matched_preds}
    change = limit
    if repeat_at & set(range(limit)):
        change = min(repeat_at & set(range(limit)))
    matched = {g for _, g in pairs}
    missed = [g for g in range(len(gts)) if g not in matched]
    # repeats after the last match, which trailing_unmatched: drop cuts: pushed down where the list goes on
    after_list = ([preds[pred_at[pos]] for pos in sorted(repeat_at) if pos >= limit]
                  if repeats == "unlikelihood" else [])
    if placement == "cut_at_skip":
        skip = first_skip([(pos, g) for pos, g in parse_pairs if pos < limit])
        if skip is not None:
            change = min(change, skip)
        if change >= limit:
            return _unchanged(limit, parse_pairs, gts, missed, after_list)
        kept_pairs = tuple((pos, g) for pos, g in parse_pairs if pos < change)
        taken = {g for _, g in kept_pairs}
        tail = tuple(TailEntry(gts[g], "fn", g) for g in range(len(gts)) if g not in taken)
        at_cut = ((0, preds[pred_at[change]]),) if change in repeat_at else ()  # its context is kept
        return TargetPlan(change, kept_pairs, tail, len(repeat_at & set(range(change, limit))),
                          at_cut if repeats == "unlikelihood" else ())
    insert_before: dict[int, list[int]] = {}  # parse position -> missed objects spliced before it
    if placement == "reading_order":
        for g in missed:
            later = [pos for pos, other in parse_pairs if other > g and pos < limit]
            if later:
                insert_before.setdefault(min(later), []).append(g)
        if insert_before:
            change = min(change, min(insert_before))
    if change >= limit:
        return _unchanged(limit, parse_pairs, gts, missed, after_list)
    tail: list[TailEntry] = []
    placed: set[int] = set()
    removed: list[tuple[int, DetObject]] = []
    for pos in range(change, limit):
        for g in insert_before.get(pos, []):
            tail.append(TailEntry(gts[g], "fn", g))
            placed.add(g)
        if pos in repeat_at:
            removed.append((len(tail), preds[pred_at[pos]]))
        if not entries_valid[pos] or pos in repeat_at:
            continue
        p, g = by_position.get(pos, (None, None))
        if p is None:
            tail.append(TailEntry(preds[pred_at[pos]], "neutral"))
        else:
            targets = tuple(float(v) for v in np.asarray(pair_targets[(p, g)], dtype=np.float64).reshape(-1))
            tail.append(TailEntry(preds[p], "matched", g, targets))
    n_removed = len(removed)
    removed += [(len(tail), obj) for obj in after_list]
    tail += [TailEntry(gts[g], "fn", g) for g in missed if g not in placed]
    kept_pairs = tuple((pos, g) for pos, g in parse_pairs if pos < change)
    return TargetPlan(change, kept_pairs, tuple(tail), n_removed, tuple(removed) if repeats == "unlikelihood" else ())


def _unchanged(limit: int, parse_pairs: Sequence[tuple[int, int]], gts: Sequence[DetObject], missed: Sequence[int],
               after_list: Sequence[DetObject]) -> TargetPlan:
    """The spec's target (or ``trailing_unmatched: drop``'s cut): the prefix up to ``limit``, then the append of
    the ``missed`` objects; with repeats cut after the list, that append written out as a tail so they have a place
    in it."""
    kept = tuple((pos, g) for pos, g in parse_pairs if pos < limit)
    if after_list:
        return TargetPlan(limit, kept, tuple(TailEntry(gts[g], "fn", g) for g in missed), 0,
                          tuple((0, obj) for obj in after_list))
    return TargetPlan(limit, kept, None)
