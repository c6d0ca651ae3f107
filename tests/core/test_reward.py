"""The reward objective's arithmetic (issue 52): outcomes from the matching, both credit forms, the leave-one-out
baseline and where each advantage lands among a rollout's tokens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.reward import (
    ObjectOutcome,
    RolloutCredit,
    RolloutOutcome,
    closing_positions,
    group_credit,
    group_figures,
    leave_one_out_advantages,
    rollout_outcome,
    sequence_reward,
    token_advantages,
)
from coordexp.schema.rollout import RewardConfig

CAT = DetObject("cat", "bbox_2d", (100, 100, 200, 200))
DOG = DetObject("dog", "bbox_2d", (500, 500, 700, 700))
rewards_lists = st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=9)


def _box(desc, x1, y1, x2, y2):
    return DetObject(desc, "bbox_2d", (x1, y1, x2, y2))


def test_leave_one_out_advantages_by_hand():
    # mean of the others: (0 + .5) / 2 = .25, (1 + .5) / 2 = .75, (1 + 0) / 2 = .5
    assert leave_one_out_advantages([1.0, 0.0, 0.5]).tolist() == pytest.approx([0.75, -0.75, 0.0])
    assert leave_one_out_advantages([2.0]).tolist() == [0.0]  # no peer, no baseline, no update


@settings(max_examples=200, deadline=None)
@given(rewards_lists, st.floats(-3, 3, allow_nan=False))
def test_leave_one_out_advantages_sum_to_zero_and_ignore_a_shift(rewards, shift):
    adv = leave_one_out_advantages(rewards)
    assert abs(adv.sum()) <= 1e-9 * max(1.0, np.abs(rewards).sum())
    assert np.allclose(leave_one_out_advantages(np.add(rewards, shift)), adv, atol=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.floats(-5, 5, allow_nan=False), st.integers(2, 9), st.booleans())
def test_a_group_of_equal_rewards_has_zero_advantage(value, n, scale):
    assert not np.any(leave_one_out_advantages([value] * n, scale_by_std=scale))


@settings(max_examples=100, deadline=None)
@given(rewards_lists, st.floats(0.1, 10))
def test_scaled_advantages_do_not_depend_on_the_reward_scale(rewards, factor):
    if np.std(rewards) < 1e-3:
        return
    a = leave_one_out_advantages(rewards, scale_by_std=True)
    b = leave_one_out_advantages(np.multiply(rewards, factor), scale_by_std=True)
    assert np.allclose(a, b, atol=1e-6)


def test_outcomes_follow_the_matchers_pairs_the_threshold_and_the_class():
    gts = [CAT, DOG]
    preds = [_box("cat", 100, 100, 200, 200),  # found, IoU 1
             _box("cat", 100, 100, 200, 200),  # a repeat of it (certified)
             _box("cow", 500, 500, 700, 700),  # paired with the dog, wrong class
             _box("sky", 900, 900, 950, 950)]  # nothing there
    pairs = [(0, 0), (2, 1)]
    repeats = [False, True, False, False]
    out = rollout_outcome(preds, gts, pairs, repeats, closed=True, iou_threshold=0.5, class_aware=True)
    assert [o.kind for o in out.objects] == ["found", "repeat", "spurious", "spurious"]
    assert out.objects[0] == ObjectOutcome("found", 0, 1.0)
    assert (out.found, out.missing) == (1, 1)
    blind = rollout_outcome(preds, gts, pairs, repeats, closed=True, iou_threshold=0.5, class_aware=False)
    assert [o.kind for o in blind.objects][2] == "found" and blind.missing == 0
    # a pair below tau is no find: IoU of [100,100,200,200] with [150,100,250,200] is 50/150
    shifted = [_box("cat", 150, 100, 250, 200)]
    low = rollout_outcome(shifted, [CAT], [(0, 0)], [False], closed=False, iou_threshold=0.5, class_aware=True)
    assert low.objects[0].kind == "spurious"
    ok = rollout_outcome(shifted, [CAT], [(0, 0)], [False], closed=False, iou_threshold=0.3, class_aware=True)
    assert ok.objects[0].iou == pytest.approx(1 / 3)


def test_sequence_reward_and_closing_reward_by_hand():
    cfg = RewardConfig(duplicate_penalty=0.3, spurious_penalty=0.2, stop_penalty=0.1, close_bonus=0.05,
                       cutoff_penalty=0.25)
    outcome = RolloutOutcome((ObjectOutcome("found", 0, 0.9), ObjectOutcome("repeat"), ObjectOutcome("spurious")),
                             gt_count=4, closed=True)
    assert sequence_reward(outcome, cfg) == pytest.approx(1 / 4 - 0.3 - 0.2)
    credit = group_credit([outcome, RolloutOutcome((), 4, closed=False)], cfg)
    assert credit[0].closing_advantage == pytest.approx(-0.3)  # 3 objects still missing x 0.1
    # a length cut closed nothing: all 4 missing and the cut-off penalty, worse than closing at the same point
    assert credit[1].closing_advantage == pytest.approx(-0.4 - 0.25)
    done = RolloutOutcome((ObjectOutcome("found", 0, 0.8),), gt_count=1, closed=True)
    assert group_credit([done, done], cfg)[0].closing_advantage == pytest.approx(0.05)
    assert sequence_reward(RolloutOutcome((), 0, True), cfg) == 0.0  # no ground truth: max(#GT, 1)


def test_baselined_closings_credit_the_close_against_the_groups_other_closes():
    cfg = RewardConfig(stop_penalty=0.1, close_bonus=0.05, cutoff_penalty=0.1, baseline_closing=True)
    early = RolloutOutcome((ObjectOutcome("found", 0, 0.9),), gt_count=3, closed=True)  # 2 missing: -0.2
    done = RolloutOutcome(tuple(ObjectOutcome("found", g, 0.9) for g in range(3)), gt_count=3, closed=True)  # +0.05
    cut = RolloutOutcome((ObjectOutcome("found", 0, 0.9), ObjectOutcome("spurious")), gt_count=3, closed=False)
    values = [-0.2, 0.05, -0.2 - 0.1]
    credit = group_credit([early, done, cut], cfg)
    expected = [v - (sum(values) - v) / 2 for v in values]
    assert [c.closing_advantage for c in credit] == pytest.approx(expected)
    assert credit[1].closing_advantage > 0 > credit[0].closing_advantage > credit[2].closing_advantage
    # every rollout closed with the same objects missing: the close is pushed neither way
    assert [c.closing_advantage for c in group_credit([early] * 3, cfg)] == [0.0] * 3
    # unbaselined (the default), the same group pushes every close down
    assert all(c.closing_advantage == pytest.approx(-0.2)
               for c in group_credit([early] * 3, RewardConfig(stop_penalty=0.1)))


def test_object_credit_compares_each_found_object_with_the_peers_on_the_same_ground_truth():
    cfg = RewardConfig(credit="object", duplicate_penalty=0.3, spurious_penalty=0.0)
    a = RolloutOutcome((ObjectOutcome("found", 0, 0.9), ObjectOutcome("found", 1, 0.6), ObjectOutcome("repeat"),
                        ObjectOutcome("spurious")), gt_count=2, closed=True)
    b = RolloutOutcome((ObjectOutcome("found", 0, 0.7),), gt_count=2, closed=True)
    c = RolloutOutcome((ObjectOutcome("found", 0, 0.8),), gt_count=2, closed=False)
    credit = group_credit([a, b, c], cfg)
    # gt 0: a 0.9 vs (0.7 + 0.8) / 2; gt 1: a 0.6 vs (0 + 0) / 2
    assert credit[0].object_advantages == pytest.approx((0.9 - 0.75, 0.6, -0.3, 0.0))
    assert credit[1].object_advantages == pytest.approx((0.7 - 0.85,))
    assert credit[2].object_advantages == pytest.approx((0.8 - 0.8,))
    assert credit[0].sequence_advantage is None


def test_object_credit_of_equally_good_rollouts_is_zero_on_every_found_object():
    cfg = RewardConfig(credit="object")
    same = RolloutOutcome((ObjectOutcome("found", 0, 0.7), ObjectOutcome("found", 1, 0.9)), 2, closed=False)
    assert all(a == 0.0 for c in group_credit([same] * 3, cfg) for a in c.object_advantages)


def test_sequence_credit_is_the_leave_one_out_advantage_of_the_rewards():
    cfg = RewardConfig(credit="sequence", duplicate_penalty=0.5)
    found = RolloutOutcome((ObjectOutcome("found", 0, 0.9),), 1, closed=True)
    repeat = RolloutOutcome((ObjectOutcome("found", 0, 0.9), ObjectOutcome("repeat")), 1, closed=True)
    empty = RolloutOutcome((), 1, closed=False)
    credit = group_credit([found, repeat, empty], cfg)
    expected = leave_one_out_advantages([1.0, 0.5, 0.0])
    assert [c.sequence_advantage for c in credit] == pytest.approx(expected.tolist())
    assert credit[2].closing_advantage is None and credit[0].closing_advantage == pytest.approx(expected[0])


def test_token_advantages_put_each_object_on_exactly_its_span_and_the_close_on_the_closing_tokens():
    credit = RolloutCredit(0.0, (0.5, -0.3), closing_advantage=-0.2)
    adv = token_advantages([(1, 4), (5, 9)], credit, 11, closing=(8, 9, 10))
    assert adv.tolist() == pytest.approx([0, .5, .5, .5, 0, -.3, -.3, -.3, -.2, -.2, -.2])
    whole = token_advantages([(1, 4)], RolloutCredit(1.0, (0.4,), 0.4, sequence_advantage=0.4), 6, closing=(5,))
    assert whole.tolist() == pytest.approx([0.4] * 6)
    with pytest.raises(ValueError, match="outside"):
        token_advantages([(3, 12)], RolloutCredit(0.0, (0.1,), None), 11, closing=())


def test_closing_positions_are_the_lists_brace_onwards_and_the_eos(tiny_tokenizer, piece_table):
    text = '{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}}'
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    closing = closing_positions(ids, piece_table, closed=True)
    assert closing[-1] == len(ids)  # the EOS appended after the rollout's tokens
    first = closing[0]
    assert b"}" in piece_table.text_of([ids[first]]) and piece_table.text_of(ids[first:]).strip().endswith(b"}")
    assert not piece_table.text_of(ids[first + 1:]).strip()  # nothing but the close after that token
    assert closing_positions(ids, piece_table, closed=False) == (len(ids) - 1,)  # cut off: its last token
    assert closing_positions([], piece_table, closed=False) == ()
    open_ids = tiny_tokenizer.encode(text[:-1] + ",", add_special_tokens=False)  # the list left open
    assert closing_positions(open_ids, piece_table, closed=True) == (len(open_ids),)


def test_group_figures_count_zero_advantage_groups_and_closings():
    credits = [RolloutCredit(0.5, (), -0.1), RolloutCredit(0.5, (), None)]
    figures = group_figures(credits, [np.zeros(3), np.zeros(2)])
    assert figures.zero_advantage and figures.reward_mean == 0.5 and figures.reward_std == 0.0
    assert (figures.closings, figures.closing_sum, figures.advantage_tokens) == (1, pytest.approx(-0.1), 5)
    assert not group_figures(credits, [np.array([0.0, 0.2]), np.zeros(1)]).zero_advantage


@st.composite
def _placements(draw):
    """Non-overlapping object spans in a rollout of ``n`` tokens, an advantage each, and a closing suffix."""
    n = draw(st.integers(1, 60))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=0, max_size=12)))
    spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2])]
    advantages = draw(st.lists(st.floats(-2, 2, allow_nan=False), min_size=len(spans), max_size=len(spans)))
    closing_from = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    closing = () if closing_from is None else tuple(range(closing_from, n))
    close = draw(st.floats(-1, 1, allow_nan=False))
    return n, spans, advantages, closing, close


@settings(max_examples=300, deadline=None)
@given(_placements())
def test_every_token_carries_its_objects_advantage_the_close_or_nothing(placement):
    n, spans, advantages, closing, close = placement
    credit = RolloutCredit(0.0, tuple(advantages), close if closing else None)
    placed = token_advantages(spans, credit, n, closing)
    for t in range(n):
        owner = [a for (start, end), a in zip(spans, advantages) if start <= t < end]
        expected = close if t in closing else (owner[0] if owner else 0.0)
        assert placed[t] == pytest.approx(expected)
