"""``training.deepspeed`` at validate: packing is allowed (multi-row micro-steps are correct under ZeRO, see
tests/e2e/test_deepspeed_torchrun.py); what cannot be made correct under DeepSpeed fails with the reason at its
dotted path (colocate offload of ZeRO-owned storage; ZeRO-3 with an adapter whose rollouts read merged weights)."""

from __future__ import annotations

import copy
import json

import pytest

from coordexp.schema.loader import validate_mapping
from coordexp.schema.training import zero_stage
from testkit import STAGE2_CONFIG

BOTH = {"enabled": True, "offload_model": True, "offload_optimizer": True}


def _report(training: dict, **sections):
    config = copy.deepcopy(STAGE2_CONFIG)
    config["training"].update(training)
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    return validate_mapping(config)


def _paths(report) -> list[str]:
    return [issue.path for issue in report.errors]


def test_deepspeed_with_packing_validates_for_both_presets():
    for preset in ("zero2", "zero3"):
        report = _report({"deepspeed": preset, "packing": True})
        assert report.ok, [i.render() for i in report.errors]


def test_zero3_with_an_adapter_that_rolls_out_is_refused_with_the_reason():
    report = _report({"deepspeed": "zero3"}, tuner={"train_type": "lora"}, rollout_matching={"rollout_backend": "hf"})
    assert _paths(report) == ["training.deepspeed"]
    text = report.errors[0].render()
    assert "under ZeRO-3 those layers hold only one rank's shard" in text and "zero2" in text
    # the same adapter under ZeRO-2, and a full fine-tune under ZeRO-3, are fine
    assert _report({"deepspeed": "zero2"}, tuner={"train_type": "lora"}, rollout_matching={"rollout_backend": "hf"}).ok
    assert _report({"deepspeed": "zero3"}, rollout_matching={"rollout_backend": "hf"}).ok
    # stage 1 without a validation set never rolls out
    stage1 = _report({"deepspeed": "zero3"}, tuner={"train_type": "lora"}, custom={"trainer_variant": "stage1_sft"})
    assert stage1.ok, [i.render() for i in stage1.errors]


def test_a_deepspeed_json_is_read_for_its_stage(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}), encoding="utf-8")
    report = _report({"deepspeed": str(path)}, tuner={"train_type": "lora"}, rollout_matching={"rollout_backend": "hf"})
    assert _paths(report) == ["training.deepspeed"]
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}), encoding="utf-8")
    assert _report({"deepspeed": str(path)}, tuner={"train_type": "lora"},
                   rollout_matching={"rollout_backend": "hf"}).ok


def test_colocate_offload_under_deepspeed_is_refused_at_its_path():
    colocate = {"rollout_backend": "vllm", "vllm": {"mode": "colocate"}, "offload": BOTH}
    report = _report({"deepspeed": "zero2"}, rollout_matching=colocate)
    assert _paths(report) == ["rollout_matching.offload.enabled"]
    assert "ZeRO owns that storage" in report.errors[0].render()
    assert _report({}, rollout_matching=colocate).ok  # offload without DeepSpeed is fine


@pytest.mark.parametrize("stage, expected", [
    (2, 2), (3, 3), ("3", 3), (3.0, 3), (" 3", 3), ("3.0", 3), (True, 1), (0, 0),  # as DeepSpeed reads them
    (4, None), (-1, None), (2.5, None), ("zero3", None), (None, None), ([3], None),
])
def test_zero_stage_reads_the_stage_as_deepspeed_does(tmp_path, stage, expected):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}}), encoding="utf-8")
    assert zero_stage(str(path)) == expected


def test_zero_stage_of_presets_and_unreadable_files(tmp_path):
    assert (zero_stage("zero2"), zero_stage("zero3"), zero_stage(None)) == (2, 3, None)
    assert zero_stage(str(tmp_path / "missing.json")) is None
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    assert zero_stage(str(tmp_path / "bad.json")) is None
    (tmp_path / "list.json").write_text("[3]", encoding="utf-8")
    assert zero_stage(str(tmp_path / "list.json")) is None
