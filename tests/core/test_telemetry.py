"""Rollout counters: summed across micro-steps/ranks, ratios recomputed from sums, fixed tensor layout, no IoU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.telemetry import (
    AMBIGUOUS_REASON,
    DEFAULT_DROP_REASONS,
    DEFAULT_PREFIX_FALLBACK_REASONS,
    RolloutCounters,
    sum_counters,
)


def sample(**overrides) -> RolloutCounters:
    args = dict(
        pred_valid=3,
        drop_reasons=["bbox_invalid", "truncated", AMBIGUOUS_REASON, "bbox_invalid"],
        gt_objects=4,
        matched=2,
        fn_appended=2,
        gating_rejections=5,
        truncated=True,
        prefix_fallback=None,
        decode_mode="greedy",
        eos_stopped=False,
        rollout_tokens=120,
    )
    args.update(overrides)
    return RolloutCounters.for_sample(**args)


def test_for_sample_counts_one_rollout():
    c = sample()
    assert c.samples == 1 and c.pred_valid == 3 and c.fp == 1
    assert dict(c.dropped_by_reason) == {"bbox_invalid": 2, "truncated": 1}
    assert c.pred_dropped == 3 and c.pred_ambiguous_excluded == 1 and c.pred_parsed == 7
    assert c.truncated_rollouts == 1 and c.decode_greedy == 1 and c.decode_beam == 0 and c.eos_stopped == 0
    fallback = sample(prefix_fallback="leading_text", decode_mode="beam", eos_stopped=True)
    assert dict(fallback.prefix_fallbacks_by_reason) == {"leading_text": 1} and fallback.prefix_fallbacks == 1
    assert fallback.decode_beam == 1 and fallback.eos_stopped == 1


def test_ratios_from_hand_counts():
    r = sample().ratios()
    assert r["parse_valid_rate"] == pytest.approx(3 / 7)
    assert r["parse_drop_rate"] == pytest.approx(3 / 7)
    assert r["ambiguous_excluded_rate"] == pytest.approx(1 / 7)
    assert r["match_rate"] == pytest.approx(2 / 4)
    assert r["match_precision"] == pytest.approx(2 / 3)
    assert r["fn_per_image"] == 2.0 and r["truncation_rate"] == 1.0 and r["rollout_tokens_per_image"] == 120.0


def test_merge_sums_counts_and_recomputes_ratios_instead_of_averaging():
    crowded = sample(pred_valid=9, drop_reasons=[], gt_objects=10, matched=9, fn_appended=1)
    sparse = sample(pred_valid=0, drop_reasons=["malformed"], gt_objects=1, matched=0, fn_appended=1)
    merged = crowded.merge(sparse)
    assert merged.samples == 2 and merged.gt_objects == 11 and merged.matched == 9
    assert merged.ratios()["match_rate"] == pytest.approx(9 / 11)
    averaged = (crowded.ratios()["match_rate"] + sparse.ratios()["match_rate"]) / 2
    assert averaged == pytest.approx(0.45) and merged.ratios()["match_rate"] != pytest.approx(averaged)
    assert dict(merged.dropped_by_reason) == {"malformed": 1} and merged.pred_ambiguous_excluded == 0
    assert crowded + sparse == merged == sum_counters([crowded, sparse])


def test_zero_denominators_give_none_and_are_left_out_of_the_log():
    empty = RolloutCounters()
    assert all(value is None for value in empty.ratios().values())
    assert sum_counters([]) == empty
    log = empty.to_log_dict()
    assert "rollout/match_rate" not in log and log["rollout/samples"] == 0.0
    no_gt = sample(gt_objects=0, matched=0, fn_appended=0)
    assert no_gt.ratios()["match_rate"] is None and no_gt.ratios()["match_precision"] == 0.0


def test_log_dict_has_counts_reasons_ratios_and_no_iou():
    log = sample(prefix_fallback="no_open_brace", cut_fallbacks=2).to_log_dict(prefix="train/rollout/")
    assert log["train/rollout/dropped/bbox_invalid"] == 2.0
    assert log["train/rollout/prefix_fallback/no_open_brace"] == 1.0
    assert log["train/rollout/prefix_fallback/cut_fallback"] == 2.0 and log["train/rollout/prefix_fallbacks"] == 3.0
    assert log["train/rollout/pred_dropped"] == 3.0 and log["train/rollout/gating_rejections"] == 5.0
    assert log["train/rollout/match_rate"] == 0.5
    assert all(isinstance(v, float) for v in log.values())
    assert not any("iou" in key.lower() for key in log)


def test_tensor_round_trip_and_sum_equals_merge():
    a = sample(prefix_fallback="leading_text")
    b = sample(drop_reasons=["non_coord_value"], decode_mode="sampling", rollout_tokens=7)
    assert RolloutCounters.from_tensor(a.to_tensor()) == a
    summed = a.to_tensor() + b.to_tensor()  # what all_reduce(SUM) does across ranks
    assert summed.dtype == torch.int64
    assert RolloutCounters.from_tensor(summed) == a.merge(b)
    layout = RolloutCounters.tensor_layout()
    assert len(layout) == a.to_tensor().numel()
    assert layout.index("dropped/bbox_invalid") == len(layout) - len(DEFAULT_PREFIX_FALLBACK_REASONS) - len(
        DEFAULT_DROP_REASONS
    ) + DEFAULT_DROP_REASONS.index("bbox_invalid")


def test_tensor_needs_every_reason_in_the_vocabulary():
    odd = sample(drop_reasons=["exotic_reason"])
    with pytest.raises(ValueError, match=r"\['exotic_reason'\] are not in the tensor vocabulary"):
        odd.to_tensor()
    vocab = ("exotic_reason", "bbox_invalid")
    assert RolloutCounters.from_tensor(odd.to_tensor(drop_reasons=vocab), drop_reasons=vocab) == odd
    with pytest.raises(ValueError, match="use the same drop/fallback reason tuples"):
        RolloutCounters.from_tensor(odd.to_tensor(drop_reasons=vocab))
    with pytest.raises(ValueError, match="repeats a reason"):
        RolloutCounters.tensor_layout(drop_reasons=("a", "a"))


def test_counters_validate_their_inputs():
    with pytest.raises(ValueError, match="non-negative int"):
        RolloutCounters(samples=-1)
    with pytest.raises(ValueError, match="non-negative int"):
        RolloutCounters(fp=1.5)
    with pytest.raises(ValueError, match="reason strings"):
        RolloutCounters(dropped_by_reason={"x": -2})
    with pytest.raises(ValueError, match="decode_mode"):
        sample(decode_mode="nucleus")
    with pytest.raises(ValueError, match="matched=5 exceeds"):
        sample(matched=5)
    frozen = RolloutCounters()
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.samples = 3
    with pytest.raises(TypeError):
        frozen.dropped_by_reason["x"] = 1


counter_strategy = st.builds(
    RolloutCounters,
    samples=st.integers(0, 50),
    pred_valid=st.integers(0, 500),
    pred_ambiguous_excluded=st.integers(0, 20),
    dropped_by_reason=st.dictionaries(st.sampled_from(DEFAULT_DROP_REASONS), st.integers(0, 30), max_size=4),
    gt_objects=st.integers(0, 500),
    matched=st.integers(0, 500),
    prefix_fallbacks_by_reason=st.dictionaries(st.sampled_from(DEFAULT_PREFIX_FALLBACK_REASONS), st.integers(0, 5)),
    rollout_tokens=st.integers(0, 10**6),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(counter_strategy, min_size=1, max_size=5))
def test_merge_is_order_independent_and_matches_tensor_sum(parts):
    forward, backward = sum_counters(parts), sum_counters(reversed(parts))
    assert forward == backward
    tensor_sum = torch.stack([p.to_tensor() for p in parts]).sum(dim=0)
    assert RolloutCounters.from_tensor(tensor_sum) == forward
    assert forward.pred_parsed == sum(p.pred_parsed for p in parts)
