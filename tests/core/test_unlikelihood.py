"""Certified repeats pushed down at their first divergent token (coordexp/runtime/core/unlikelihood.py;
docs/design.md, decision 18): the plan is drop's, and each removed repeat becomes one negative where writing it again
would leave the target."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.parsing import cut_after_objects, parse_rollout
from coordexp.runtime.core.placement import plan_target
from coordexp.runtime.core.targets import build_train_target
from coordexp.runtime.core.unlikelihood import first_divergence, with_repeat_negatives
from coordexp.schema.pipeline import TokenCeConfig

from tests.core.test_placement import GT, _rollout_text, box, rollout_case
from tests.core.test_targets_properties import SETTINGS

CE = TokenCeConfig(rollout_fn_desc_weight=1.0, rollout_matched_prefix_struct_weight=1.0)


def _target(tok, vocab, table, gts, preds, pairs, placement="append", repeats="unlikelihood", trailing="keep"):
    ids = tok.encode(_rollout_text(preds), add_special_tokens=False)
    parse = parse_rollout(ids, tok, vocab)
    valid = [i for i, o in enumerate(parse.objects) if o.valid]
    targets = {(p, g): np.asarray(gts[g].coords, dtype=float) for p, g in pairs}
    plan = plan_target([o.valid for o in parse.objects], preds, valid, gts, pairs, targets, placement=placement,
                       repeats=repeats, trailing=trailing)
    cut = parse if plan.kept == len(parse.objects) else cut_after_objects(parse, plan.kept, tok, vocab)
    target = build_train_target(cut, gts, list(plan.prefix_pairs), [targets[p] for p in plan.prefix_pairs], tok,
                                vocab, field_order="desc_first", token_ce=CE, eos_id=tok.eos_token_id,
                                tail=plan.tail)
    return plan, with_repeat_negatives(target, cut, plan.repeats_at, tok, vocab, table, "desc_first"), target


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_a_repeat_before_another_object_is_pushed_down_at_its_first_coordinate(tiny_tokenizer, coord_vocab,
                                                                               piece_table):
    preds = [GT[0], GT[0], GT[1]]  # GT 0 written twice, then GT 1: same desc, so they part at x1 (0 vs 100)
    plan, target, plain = _target(tiny_tokenizer, coord_vocab, piece_table, GT, preds, [(0, 0), (2, 1)])
    dropped = plan_target([True] * 3, preds, [0, 1, 2], GT, [(0, 0), (2, 1)],
                          {(0, 0): np.asarray(GT[0].coords, float), (2, 1): np.asarray(GT[1].coords, float)},
                          repeats="drop")
    assert (plan.kept, plan.tail, plan.repeats_removed) == (dropped.kept, dropped.tail, dropped.repeats_removed)
    assert plan.repeats_at == ((0, GT[0]),) and dropped.repeats_at == ()
    assert target.ids == plain.ids  # the negatives change no token and no other supervision
    sup = target.supervision
    assert np.array_equal(sup.ce_positions, plain.supervision.ce_positions)
    assert sup.ul_positions.size == 1
    pos, neg = int(sup.ul_positions[0]), int(sup.ul_tokens[0])
    assert neg == coord_vocab.ids[0] and int(sup.ul_bins[0]) == 0  # the repeat's x1
    assert target.ids[pos] == coord_vocab.ids[100]  # where the clean target writes GT 1's x1
    assert int(sup.ul_exclude[0]) == 100  # its own target's band is spared
    first_tail_coord = sup.coord_positions[sup.coord_positions >= target.prefix_len].min()
    assert pos == first_tail_coord


def test_a_repeat_written_instead_of_closing_is_pushed_down_at_the_continuing_token(tiny_tokenizer, coord_vocab,
                                                                                    piece_table):
    preds = [GT[0], GT[1], GT[2], GT[3], GT[3]]  # every object found, then the last one again
    plan, target, _ = _target(tiny_tokenizer, coord_vocab, piece_table, GT, preds, [(k, k) for k in range(4)])
    assert plan.kept == 4 and plan.tail == () and plan.repeats_at == ((0, GT[3]),)
    sup = target.supervision
    assert sup.ul_positions.size == 1 and int(sup.ul_bins[0]) == -1 and int(sup.ul_exclude[0]) == -1
    pos, neg = int(sup.ul_positions[0]), int(sup.ul_tokens[0])
    decode = tiny_tokenizer.decode
    clean_text, neg_text = decode([target.ids[pos]]), decode([neg])
    assert "}" in clean_text and "," in neg_text  # the list closes where the repeat went on
    assert decode(list(target.ids[:pos]) + [neg]).rstrip().endswith(",")


def test_neutral_and_drop_carry_no_negatives(tiny_tokenizer, coord_vocab, piece_table):
    preds = [GT[0], GT[0], GT[1]]
    for repeats in ("neutral", "drop"):
        plan, target, _ = _target(tiny_tokenizer, coord_vocab, piece_table, GT, preds, [(0, 0), (2, 1)],
                                  repeats=repeats)
        assert plan.repeats_at == () and target.supervision.ul_positions.size == 0


def test_two_repeats_at_one_boundary_with_one_first_token_count_once(tiny_tokenizer, coord_vocab, piece_table):
    preds = [GT[0], GT[0], GT[0], GT[1]]  # the same repeat twice in a row: one (position, token)
    plan, target, _ = _target(tiny_tokenizer, coord_vocab, piece_table, GT, preds, [(0, 0), (3, 1)])
    assert plan.repeats_removed == 2 and len(plan.repeats_at) == 2
    assert target.supervision.ul_positions.size == 1


@given(case=rollout_case(), placement=st.sampled_from(["append", "reading_order", "cut_at_skip"]),
       trailing=st.sampled_from(["keep", "drop"]))
@SETTINGS
def test_negatives_are_other_tokens_inside_the_tail(tiny_tokenizer, coord_vocab, piece_table, case, placement,
                                                   trailing):
    gts, preds = case
    taken: set[int] = set()
    pairs = []
    for p, pred in enumerate(preds):
        g = next((g for g, obj in enumerate(gts) if obj == pred and g not in taken), None)
        if g is not None:
            taken.add(g)
            pairs.append((p, g))
    plan, target, plain = _target(tiny_tokenizer, coord_vocab, piece_table, gts, preds, pairs, placement=placement,
                                  trailing=trailing)
    _, dropped, _ = _target(tiny_tokenizer, coord_vocab, piece_table, gts, preds, pairs, placement=placement,
                            repeats="drop", trailing=trailing)
    sup = target.supervision
    assert target.ids == plain.ids == dropped.ids  # the same Y_train as drop's, negatives aside
    assert np.array_equal(sup.ce_weights, dropped.supervision.ce_weights)
    assert sup.ul_positions.size <= len(plan.repeats_at)
    if trailing == "keep" and placement != "cut_at_skip":  # cut_at_skip keeps only the context of the one at its cut
        assert len(plan.repeats_at) == plan.repeats_removed
    pairs_at = list(zip(sup.ul_positions.tolist(), sup.ul_tokens.tolist()))
    assert len(set(pairs_at)) == len(pairs_at)
    repeat_bins = {c for _, obj in plan.repeats_at for c in obj.coords}
    for (pos, neg), b in zip(pairs_at, sup.ul_bins.tolist()):
        assert target.prefix_len <= pos < len(target.ids) - 1 and target.ids[pos] != neg
        if b >= 0:
            assert neg == coord_vocab.ids[b] and b in repeat_bins
    if not plan.repeats_at:
        assert sup.ul_positions.size == 0


def test_a_jittered_repeat_is_pushed_down_where_its_coordinates_part(tiny_tokenizer, coord_vocab, piece_table):
    jitter = box(2)  # IoU >= 0.9 with GT 0, same desc: certified, though its coordinates differ
    preds = [GT[0], jitter, GT[2]]
    plan, target, _ = _target(tiny_tokenizer, coord_vocab, piece_table, GT, preds, [(0, 0), (2, 2)])
    assert plan.repeats_removed == 1
    sup = target.supervision
    # the jitter's x1 against the next entry's, GT 2's (GT 1, missed, is appended after the list)
    assert sup.ul_positions.size == 1 and int(sup.ul_bins[0]) == 2
    assert target.ids[int(sup.ul_positions[0])] == coord_vocab.ids[200] and int(sup.ul_exclude[0]) == 200


def test_a_repeat_after_the_last_match_is_pushed_down_where_the_list_goes_on(tiny_tokenizer, coord_vocab,
                                                                            piece_table):
    ghost = DetObject("cat", "bbox_2d", (900, 900, 950, 950))
    preds = [GT[0], GT[1], GT[1], ghost]  # trailing_unmatched: drop cuts the repeat and the FP after GT 1
    plan, target, plain = _target(tiny_tokenizer, coord_vocab, piece_table, GT, preds, [(0, 0), (1, 1)],
                                  trailing="drop")
    _, dropped, _ = _target(tiny_tokenizer, coord_vocab, piece_table, GT, preds, [(0, 0), (1, 1)],
                            repeats="drop", trailing="drop")
    assert plan.kept == 2 and plan.repeats_removed == 0 and plan.repeats_at == ((0, GT[1]),)
    assert target.ids == dropped.ids and np.array_equal(target.supervision.ce_positions,
                                                        dropped.supervision.ce_positions)
    sup = target.supervision
    assert sup.ul_positions.size == 1 and int(sup.ul_bins[0]) == 100  # GT 1's x1 again, where GT 2 (missed) starts
    assert target.ids[int(sup.ul_positions[0])] == coord_vocab.ids[200]
