"""The demo's stage-1 stop: it waits for the match target too, since the format is learned long before where the
shapes are (a 300-step run at the old parse-only target stopped with match 5.7% and box AP50 0)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordexp.runtime.core.telemetry import RolloutCounters
from coordexp.runtime.toy import demo


def _counters(parsed: int, valid: int, gt: int, matched: int) -> RolloutCounters:
    return RolloutCounters(samples=4, pred_valid=valid, dropped_by_reason={"invalid": parsed - valid}, gt_objects=gt, matched=matched)


@pytest.mark.parametrize(
    ("counters", "stops"),
    [
        (_counters(parsed=10, valid=9, gt=10, matched=1), False),  # parses, does not localise: keep training
        (_counters(parsed=10, valid=5, gt=10, matched=6), False),  # localises the few it parses
        (_counters(parsed=10, valid=9, gt=10, matched=6), True),
        (_counters(parsed=0, valid=0, gt=10, matched=0), False),
    ],
)
def test_stage1_stops_only_at_both_targets(monkeypatch, counters, stops):
    monkeypatch.setattr(demo, "evaluate", lambda trainer, records, with_loss: demo.RolloutEval(counters, None))
    stop = demo.Stage1TargetStop(SimpleNamespace(), [], every=5, parse_target=0.8, match_target=0.5,
                                 log=lambda _: None)
    control = SimpleNamespace(should_training_stop=False)
    state = SimpleNamespace(global_step=5, max_steps=100)
    stop.on_step_end(None, state, control)
    assert control.should_training_stop is stops and stop.reached is stops
    assert [step for step, _ in stop.history] == [5]
    stop.on_step_end(None, SimpleNamespace(global_step=7, max_steps=100), control)
    assert len(stop.history) == 1  # checks only every `every` steps
