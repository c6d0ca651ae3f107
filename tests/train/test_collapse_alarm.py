"""The stage-2 collapse alarm (coordexp/runtime/train/collapse.py): which window figures fire it, once per crossing,
and what ``action: stop`` does to the trainer's control and log history."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from coordexp.runtime.train.collapse import CollapseCallback, CollapseWatch
from coordexp.runtime.train.progress import summarize_history
from coordexp.schema.rollout import CollapseAlarmConfig


def window(per_gt=1.0, precision=0.6, dup=0.0, trunc=0.0, valid=0.99):
    return {"rollout/samples": 8.0, "rollout/pred_per_gt": per_gt, "rollout/match_precision": precision,
            "rollout/duplicate_rate": dup, "rollout/cut_off_rate": trunc, "rollout/parse_valid_rate": valid}


def test_the_upstream_collapse_fires_and_a_healthy_run_does_not():
    watch = CollapseWatch(CollapseAlarmConfig())
    assert watch.check(window(1.09, 0.61)) == []
    assert watch.check(window(1.2, 0.60)) == []
    # many predictions per object, but precision held: more finds, not a collapse
    assert watch.check(window(1.8, 0.58)) == []
    fired = watch.check(window(3.05, 0.25, trunc=0.156))
    assert len(fired) == 2 and "3.05 predictions per GT" in fired[0] and "25.0%" in fired[0]
    assert "15.6%" in fired[1]
    assert watch.check(window(3.1, 0.24, trunc=0.16)) == []  # said once per crossing
    assert watch.check(window(1.0, 0.6)) == []  # back inside: re-armed
    assert len(watch.check(window(3.0, 0.2))) == 1


def test_duplicates_and_parse_validity_have_their_own_bounds():
    watch = CollapseWatch(CollapseAlarmConfig(duplicate_rate_max=0.1, parse_valid_min=0.9))
    fired = watch.check(window(dup=0.3, valid=0.5))
    assert [("repeat an earlier" in r, "valid" in r) for r in fired] == [(True, False), (False, True)]


def test_a_window_under_min_gt_objects_is_not_judged():
    """A 7-object window fired the alarm in a user's run (one object is 14 points of its rates): under the minimum
    it is skipped and remembered nowhere; at the minimum it is judged."""
    watch = CollapseWatch(CollapseAlarmConfig())
    assert CollapseAlarmConfig().min_gt_objects == 20
    assert watch.check({**window(trunc=0.9, valid=0.1), "rollout/gt_objects": 7.0}) == []
    assert watch.best_precision is None and not watch.crossed
    assert len(watch.check({**window(trunc=0.9, valid=0.1), "rollout/gt_objects": 20.0})) == 2
    every = CollapseWatch(CollapseAlarmConfig(min_gt_objects=0))
    assert len(every.check({**window(trunc=0.9), "rollout/gt_objects": 1.0})) == 1


def test_bounds_are_validated():
    with pytest.raises(ValidationError):
        CollapseAlarmConfig(duplicate_rate_max=1.5)
    with pytest.raises(ValidationError):
        CollapseAlarmConfig(pred_per_gt_max=float("inf"))
    for bad in (-1, 1_000_001, 2.5, True):
        with pytest.raises(ValidationError, match="min_gt_objects"):
            CollapseAlarmConfig(min_gt_objects=bad)
    with pytest.raises(ValidationError, match="0 judges every window"):
        CollapseAlarmConfig(min_gt_objects=-1)


def test_stop_saves_ends_the_run_and_the_summary_says_why():
    said, recorded = [], []
    callback = CollapseCallback(CollapseAlarmConfig(action="stop", cut_off_rate_max=0.1), say=said.append,
                                record=lambda event, **kw: recorded.append((event, kw)))
    state = SimpleNamespace(global_step=7, is_world_process_zero=True, log_history=[{"loss": 1.0, "step": 7}])
    control = SimpleNamespace(should_save=False, should_training_stop=False)
    callback.on_log(None, state, control, logs={"loss": 1.0, **window(trunc=0.5)})
    assert control.should_save and control.should_training_stop
    assert said and "step 7" in said[0] and recorded[0][0] == "collapse_alarm"
    summary = summarize_history(state.log_history)
    assert summary["collapse_alarms"] == [{"step": 7, "reasons": recorded[0][1]["reasons"][0], "action": "stop"}]
    # evaluations never feed the alarm
    quiet = CollapseCallback(CollapseAlarmConfig(cut_off_rate_max=0.1), say=said.append, record=lambda *a, **k: 0)
    quiet.on_log(None, state, control, logs={"eval/AP50": 0.1, **window(trunc=0.9)})
    assert len(said) == 1
