"""FN placement and certified-repeat removal (coordexp/runtime/core/placement.py; docs/design.md, decision 18):
hand-built plans, then random rollouts rebuilt into Y_train with each placement and repeat treatment, checked by
re-parsing the target: the prefix is token-identical up to the first change, every object is where the plan says,
and nothing outside the taught entries is supervised."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.parsing import cut_after_objects, parse_rollout
from coordexp.runtime.core.placement import first_skip, plan_target
from coordexp.runtime.core.set_figures import certified_duplicates
from coordexp.runtime.core.targets import build_train_target
from coordexp.runtime.core.serialize import render_entries
from coordexp.schema.pipeline import TokenCeConfig

from tests.core.test_targets_properties import SETTINGS


def box(x, desc="cat"):
    return DetObject(desc, "bbox_2d", (x, 10, x + 50, 60))


GT = [box(0), box(100), box(200), box(300)]  # reading order: left to right


def plan(preds, pairs, **kw):
    targets = {(p, g): np.asarray(GT[g].coords, dtype=float) for p, g in pairs}
    return plan_target([True] * len(preds), preds, list(range(len(preds))), GT, pairs, targets, **kw)


def test_first_skip_is_the_first_entry_written_past_an_untaken_object():
    assert first_skip([(0, 0), (1, 1), (2, 2)]) is None
    assert first_skip([(0, 0), (1, 2), (2, 1)]) == 1  # object 1 skipped, written after (a backtrack)
    assert first_skip([(0, 1)]) == 0


def test_the_spec_target_is_unchanged_without_a_reason():
    preds = [GT[0], GT[1], GT[2], GT[3]]
    pairs = [(0, 0), (1, 1), (2, 2), (3, 3)]
    for placement in ("append", "reading_order", "cut_at_skip"):
        p = plan(preds, pairs, placement=placement, repeats="drop")
        assert (p.kept, p.tail, p.prefix_pairs) == (4, None, tuple(pairs))


def test_reading_order_splices_the_missed_object_where_it_was_skipped():
    preds = [GT[0], GT[2], box(700), GT[3]]  # skipped GT 1, one FP at 700
    p = plan(preds, [(0, 0), (1, 2), (3, 3)], placement="reading_order")
    assert p.kept == 1 and p.prefix_pairs == ((0, 0),)
    assert [(e.role, e.gt_index, e.obj) for e in p.tail] == [("fn", 1, GT[1]), ("matched", 2, GT[2]),
                                                             ("neutral", None, box(700)), ("matched", 3, GT[3])]
    assert p.tail[1].coord_targets == tuple(float(v) for v in GT[2].coords)


def test_cut_at_skip_rolls_in_with_the_model_and_out_with_the_ground_truth():
    preds = [GT[0], box(700), GT[2], GT[1]]
    p = plan(preds, [(0, 0), (2, 2), (3, 1)], placement="cut_at_skip")
    assert p.kept == 2 and p.prefix_pairs == ((0, 0),)  # the FP before the skip stays, neutral
    assert [(e.role, e.gt_index) for e in p.tail] == [("fn", 1), ("fn", 2), ("fn", 3)]


def test_repeats_drop_removes_only_certified_unmatched_repeats():
    preds = [GT[0], GT[0], GT[1], box(702), box(700)]  # a repeat of GT 0; a jitter pair of FPs (IoU >= 0.9)
    pairs = [(0, 0), (2, 1)]
    assert certified_duplicates(preds, GT) == [False, True, False, False, True]
    p = plan(preds, pairs, repeats="drop")
    assert p.kept == 1 and p.repeats_removed == 2
    assert [(e.role, e.gt_index) for e in p.tail] == [("matched", 1), ("neutral", None), ("fn", 2), ("fn", 3)]
    trailing = plan(preds, pairs, repeats="drop", trailing="drop")  # entries after the last match are cut first
    assert [(e.role, e.gt_index) for e in trailing.tail] == [("matched", 1), ("fn", 2), ("fn", 3)]


def _rollout_text(objects):
    return "{" + render_entries(objects, 1, "desc_first").text + "}"


@st.composite
def rollout_case(draw):
    n_gt = draw(st.integers(1, 6))
    xs = sorted(draw(st.lists(st.integers(0, 18), min_size=n_gt, max_size=n_gt, unique=True)))
    gts = [DetObject(draw(st.sampled_from(["cat", "dog"])), "bbox_2d", (50 * x, 20, 50 * x + 40, 80)) for x in xs]
    written = draw(st.lists(st.integers(-1, n_gt - 1), max_size=8))  # gt index written, -1 a free FP
    preds = []
    for g in written:
        if g < 0:
            x = draw(st.integers(0, 950))
            preds.append(DetObject("cat", "bbox_2d", (x, 900, min(999, x + 40), 960)))
        else:
            preds.append(gts[g])
    return gts, preds


@given(case=rollout_case(), placement=st.sampled_from(["append", "reading_order", "cut_at_skip"]),
       repeats=st.sampled_from(["neutral", "drop"]), trailing=st.sampled_from(["keep", "drop"]),
       fn_desc=st.sampled_from([0.0, 1.0]), struct=st.sampled_from([0.0, 1.0]))
@SETTINGS
def test_placed_targets_parse_into_the_plan(tiny_tokenizer, coord_vocab, piece_table, case, placement, repeats,
                                            trailing, fn_desc, struct):
    gts, preds = case
    ids = tiny_tokenizer.encode(_rollout_text(preds), add_special_tokens=False)
    parse = parse_rollout(ids, tiny_tokenizer, coord_vocab)
    valid = [i for i, o in enumerate(parse.objects) if o.valid]
    assert len(valid) == len(preds)
    taken: set[int] = set()
    pairs = []
    for p, pred in enumerate(preds):  # match exact copies, first come
        g = next((g for g, obj in enumerate(gts) if obj == pred and g not in taken), None)
        if g is not None:
            taken.add(g)
            pairs.append((p, g))
    targets = {(p, g): np.asarray(gts[g].coords, dtype=float) + 0.25 for p, g in pairs}
    plan_ = plan_target([o.valid for o in parse.objects], preds, valid, gts, pairs, targets, placement=placement,
                        repeats=repeats, trailing=trailing)
    cut = parse if plan_.kept == len(parse.objects) else cut_after_objects(parse, plan_.kept, tiny_tokenizer,
                                                                           coord_vocab)
    ce = TokenCeConfig(rollout_fn_desc_weight=fn_desc, rollout_matched_prefix_struct_weight=struct)
    target = build_train_target(cut, gts, list(plan_.prefix_pairs), [targets[(p, g)] for p, g in plan_.prefix_pairs],
                                tiny_tokenizer, coord_vocab, field_order="desc_first", token_ce=ce,
                                eos_id=tiny_tokenizer.eos_token_id, tail=plan_.tail)
    # the rollout's tokens are kept up to the first change
    assert target.ids[:target.prefix_len] == tuple(ids[:target.prefix_len])
    again = parse_rollout(list(target.ids), tiny_tokenizer, coord_vocab)
    assert again.stopped_at_eos and not again.truncated and all(o.valid for o in again.objects)
    expected = [preds[valid.index(pos)] for pos in range(plan_.kept)]
    entries = plan_.tail if plan_.tail is not None else [gts[g] for g in range(len(gts))
                                                         if g not in {g for _, g in plan_.prefix_pairs}]
    expected += [e.obj if hasattr(e, "obj") else e for e in entries]
    assert [o.to_det_object() for o in again.objects] == expected
    # every ground-truth object is taught exactly once: matched in the prefix, matched in the tail, or missed
    taught = [g for _, g in plan_.prefix_pairs] + [e.gt_index for e in (plan_.tail or ()) if e.role != "neutral"]
    taught += list(target.fn_gt_indices) if plan_.tail is None else []
    assert sorted(taught) == sorted(set(taught)) and set(taught) >= set(range(len(gts))) - {
        g for _, g in pairs} - {g for _, g in plan_.prefix_pairs}
    if placement == "reading_order" and plan_.tail is not None:  # a missed object sits before any later match
        order = [(e.role, e.gt_index) for e in plan_.tail if e.role != "neutral"]
        for k, (role, g) in enumerate(order):
            if role == "fn":
                assert all(other < g or r == "fn" for r, other in order[:k] if r == "matched")
    # supervision: coord slots only on taught objects, with their targets; nothing inside neutral entries
    sup = target.supervision
    n_prefix = plan_.kept
    taught_coords = [i for o, e in zip(again.objects[n_prefix:], plan_.tail or []) if e.role != "neutral"
                     for i in o.coord_token_indices] if plan_.tail is not None else [
        i for o in again.objects[n_prefix:] for i in o.coord_token_indices]
    tail_slots = sup.coord_positions[sup.coord_positions >= target.prefix_len].tolist()
    assert tail_slots == taught_coords
    if plan_.tail is not None:
        neutral = [o for o, e in zip(again.objects[n_prefix:], plan_.tail) if e.role == "neutral"]
        # tokens inside a neutral entry (its first token may carry the previous entry's close, its last one the
        # list's close, which a neutral entry still ends with: both are taught where their last byte says)
        inside = {i for o in neutral
                  for i in range(o.token_span[0] + 1, min(o.token_span[1] - 1, len(target.ids) - 2))}
        assert not inside & set(sup.ce_positions.tolist()) and not inside & set(sup.coord_positions.tolist())
        values = sup.coord_targets[sup.coord_positions >= target.prefix_len]
        want = [v for e in plan_.tail if e.role != "neutral"
                for v in (e.obj.coords if e.role == "fn" else e.coord_targets)]
        assert values.tolist() == pytest.approx(want)
    assert sup.ce_positions[-1] == len(target.ids) - 1


def test_gap_prefixes_are_drawn_by_the_mix():
    import random

    from coordexp.runtime.train.rollout_step import gt_prefix
    from coordexp.schema.data import GtPrefixMix

    draw = random.Random(0)
    assert gt_prefix(5, GtPrefixMix(), draw) == ()
    assert gt_prefix(5, GtPrefixMix(none=0, all=1), draw) == (0, 1, 2, 3, 4)
    loo = [gt_prefix(5, GtPrefixMix(none=0, leave_one_out=1), draw) for _ in range(50)]
    assert all(len(p) == 4 and list(p) == sorted(p) for p in loo) and len(set(loo)) == 5
    subsets = [gt_prefix(5, GtPrefixMix(none=0, random_subset=1), draw) for _ in range(100)]
    assert all(1 <= len(p) <= 4 and list(p) == sorted(p) for p in subsets)
    assert gt_prefix(1, GtPrefixMix(none=0, leave_one_out=1), draw) == ()  # nothing to leave out of one object
    with pytest.raises(Exception, match="every weight is 0"):
        GtPrefixMix(none=0)
