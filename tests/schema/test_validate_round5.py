"""Issue 37's config rules outside the DeepSpeed file: ``save_strategy: best`` with no evaluation that can run,
``report_to: tensorboard`` without the package, and the "no effect" warning of ``gt_step_share`` in stage 1."""

from __future__ import annotations

import copy
import importlib.util

import pytest

from coordexp.schema.loader import validate_mapping
from testkit import STAGE2_CONFIG

BEST = {"save_strategy": "best", "metric_for_best_model": "AP"}


def _report(training: dict, **sections):
    config = copy.deepcopy(STAGE2_CONFIG)
    for key, value in {"training": training, **sections}.items():
        config[key] = {**config.get(key, {}), **value}
    return validate_mapping(config)


@pytest.mark.parametrize("training, data, missing", [
    ({**BEST, "eval_steps": 10}, {}, "data.val_jsonl is not set"),
    (BEST, {"val_jsonl": "data/val.jsonl"}, "training.eval_steps is not set"),
    ({**BEST, "eval_strategy": "no", "eval_steps": 10}, {"val_jsonl": "data/val.jsonl"}, "eval_steps"),
])
def test_save_strategy_best_without_an_evaluation_is_refused_with_the_fix(training, data, missing):
    report = _report(training, data=data)
    assert [issue.path for issue in report.errors] == ["training.save_strategy"]
    text = report.errors[0].render()
    assert "would write no checkpoint" in text and "Set data.val_jsonl and training.eval_steps" in text


def test_save_strategy_best_with_an_evaluation_validates():
    assert _report({**BEST, "eval_steps": 10}, data={"val_jsonl": "data/val.jsonl"}).ok
    assert _report({**BEST, "eval_strategy": "steps"}, data={"val_jsonl": "data/val.jsonl"}).ok


@pytest.mark.parametrize("report_to", [["tensorboard"], "tensorboard", ["wandb", "tensorboard"]])
def test_tensorboard_without_the_package_is_a_valid_file(monkeypatch, report_to):
    """A missing package is the machine's state, not the file's (issue 56, item 28): validate warns and train exits
    3 before the model loads, as for every optional package (tests/cli/test_round7_run_folder.py)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "tensorboardX") else real(name, *a))
    assert _report({"report_to": report_to}).ok


def test_tensorboard_with_the_package_validates(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert _report({"report_to": ["tensorboard"]}).ok


def test_gt_step_share_in_a_stage1_config_warns_it_has_no_effect():
    report = _report({}, custom={"trainer_variant": "stage1_sft"}, rollout_matching={"gt_step_share": 0.5})
    assert report.ok
    assert [w.path for w in report.warnings] == ["rollout_matching.gt_step_share"]
    assert "no effect in stage1_sft" in report.warnings[0].message
    stage2 = _report({}, rollout_matching={"gt_step_share": 0.5})
    assert "rollout_matching.gt_step_share" not in [w.path for w in stage2.warnings]
