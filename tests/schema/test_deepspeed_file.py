"""A ``training.deepspeed`` JSON file at ``validate`` (issue 37): read bounded (no FIFO hang, no endless device,
no RecursionError), and its content refused with the reason at ``training.deepspeed`` the way transformers'
``HfTrainerDeepSpeedConfig`` and DeepSpeed would refuse it after the model loaded; the property tests keep the
table equal to what the real objects refuse."""

from __future__ import annotations

import copy
import json
import math
import os
import threading
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.schema.deepspeed_file import deepspeed_stage, transformers_mismatches
from coordexp.schema.loader import validate_mapping
from coordexp.schema.training import TrainingConfig
from testkit import STAGE2_CONFIG

LORA_ROLLING_OUT = {"tuner": {"train_type": "lora"}, "rollout_matching": {"rollout_backend": "hf"}}


def _report(ds_path, training: dict | None = None, **sections):
    config = copy.deepcopy(STAGE2_CONFIG)
    config["training"].update({"deepspeed": str(ds_path), **(training or {})})
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    return validate_mapping(config)


def _errors(report) -> list[str]:
    return [issue.render() for issue in report.errors]


def _file(tmp_path, content, name="ds.json"):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.append(_report(fifo)), daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():  # the old code blocked in open(): unblock it so the suite goes on, then fail
        with open(fifo, "w"):
            pass
        pytest.fail("validate waited on a FIFO named by training.deepspeed")
    assert any("FIFO" in text and text.startswith("training.deepspeed") for text in _errors(outcome[0]))


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_an_endless_device_is_read_only_up_to_the_cap(device):
    if not os.path.exists(device):
        pytest.skip(f"needs {device}")
    report = _report(device)
    assert any("KiB cap" in text for text in _errors(report)), _errors(report)


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs /proc")
def test_proc_self_mem_is_refused_as_unreadable():
    assert any("cannot read file" in text for text in _errors(_report("/proc/self/mem")))


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 5_000 + "1" + "}" * 5_000])
def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path, text):
    report = _report(_file(tmp_path, text))
    assert any("nested deeper" in t for t in _errors(report)), _errors(report)


@pytest.mark.parametrize("content, words", [
    ([], "holds list, not a JSON object"), (None, "holds NoneType"), ("zero2", "holds str"),
    ({"zero_optimization": [2]}, "zero_optimization is list"),
    ({"zero_optimization": {"stage": 4}}, "DeepSpeed has stages 0, 1, 2 and 3"),
    ({"zero_optimization": {"stage": -1}}, "DeepSpeed has stages"),
    ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu is 4 but"),
    ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps is 8 but"),
    ({"train_batch_size": 0}, "train_batch_size is 0"), ({"train_batch_size": "8"}, "train_batch_size is 8"),
    ({"gradient_clipping": 5.0}, "gradient_clipping is 5.0 but training.max_grad_norm is 1.0"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping is nan"),
    ({"bf16": {"enabled": True}}, "bf16.enabled is True but training.bf16"),
    ({"fp16": {"enabled": True}}, "fp16.enabled is True but training.fp16"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": float("nan")}}}, "the optimizer block would replace"),
    ({"scheduler": {"type": "WarmupLR"}}, "the scheduler block would replace"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/dev/null/nvme"}}},
     "which cannot be created (/dev/null is not a folder)"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}, "device is 'gpu'"),
])
def test_content_transformers_or_deepspeed_refuse_fails_at_validate(tmp_path, content, words):
    texts = _errors(_report(_file(tmp_path, json.dumps(content))))  # NaN as json.dumps (and Python's json) writes it
    assert any(t.startswith("training.deepspeed: ") and words in t for t in texts), texts


def test_bf16_on_a_float32_model_is_refused_and_auto_agrees(tmp_path):
    path = _file(tmp_path, {"bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
                            "gradient_clipping": 1.0, "train_batch_size": 4, "zero_optimization": {"stage": 2}})
    assert _report(path, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}).ok
    texts = _errors(_report(path, {"bf16": True}, model={"dtype": "float32"}))
    assert any("cast the model to bfloat16, but model.dtype is float32" in t for t in texts), texts
    assert _report(path, {"bf16": True}).ok  # a bfloat16 model (the default dtype)


@pytest.mark.parametrize("stage", ["3", 3.0, " 3"])
def test_stage_three_written_as_deepspeed_reads_it_hits_the_zero3_adapter_refusal(tmp_path, stage):
    report = _report(_file(tmp_path, {"zero_optimization": {"stage": stage}}), **LORA_ROLLING_OUT)
    assert any("ZeRO-3 with tuner.train_type: lora" in t for t in _errors(report)), _errors(report)
    # and on its own: transformers' is_zero3() reads only the integer, so the two would disagree
    texts = _errors(_report(_file(tmp_path, {"zero_optimization": {"stage": stage}})))
    assert any('Write the integer: "stage": 3' in t for t in texts), texts


def test_the_cli_exits_2_with_one_line_per_problem_before_any_model_loads(tmp_path, stage2_config):
    import yaml

    ds = _file(tmp_path, {"zero_optimization": {"stage": 4}})
    stage2_config["training"]["deepspeed"] = str(ds)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(stage2_config), encoding="utf-8")
    result = CliRunner().invoke(app, ["validate", str(config)], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "training.deepspeed" in result.output and "DeepSpeed has stages" in result.output


# --- the table against the real objects ---------------------------------------------------------------------------

_VALUES = st.sampled_from([None, "auto", 1, 2, 4, 2.0, "2", 0, -1, True, float("nan")])
_FLAGS = st.sampled_from([None, "auto", True, False, "true", 0, 1])


@settings(max_examples=150, deadline=None)
@given(micro=_VALUES, accumulation=_VALUES, batch=_VALUES, clipping=_VALUES, bf16=_FLAGS, fp16=_FLAGS,
       hf_micro=st.sampled_from([1, 2]), hf_accumulation=st.sampled_from([1, 2]),
       hf_clip=st.sampled_from([0.0, 1.0, 2.0]), hf_bf16=st.booleans(), hf_fp16=st.booleans())
def test_mismatches_equal_what_transformers_refuses(micro, accumulation, batch, clipping, bf16, fp16, hf_micro,
                                                   hf_accumulation, hf_clip, hf_bf16, hf_fp16):
    deepspeed_integration = pytest.importorskip("transformers.integrations.deepspeed",
                                                reason="transformers' DeepSpeed integration is not installed")
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (transformers' config needs it)")
    ds: dict = {}
    for key, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accumulation),
                       ("train_batch_size", batch), ("gradient_clipping", clipping)):
        if value is not None:
            ds[key] = value
    for key, value in (("bf16", bf16), ("fp16", fp16)):
        if value is not None:
            ds[key] = {"enabled": value}
    training = TrainingConfig.model_validate({
        "output_dir": "runs/x", "per_device_train_batch_size": hf_micro, "gradient_accumulation_steps": hf_accumulation,
        "max_grad_norm": hf_clip, "bf16": hf_bf16, "fp16": hf_fp16 and not hf_bf16})
    args = SimpleNamespace(
        world_size=1, per_device_train_batch_size=hf_micro, gradient_accumulation_steps=hf_accumulation,
        max_grad_norm=hf_clip, learning_rate=training.learning_rate, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, weight_decay=0.0, save_on_each_node=False, fp16=training.fp16, bf16=training.bf16,
        fp16_full_eval=False, bf16_full_eval=False)
    real = deepspeed_integration.HfTrainerDeepSpeedConfig(copy.deepcopy(ds))
    try:
        real.trainer_config_process(args)
    finally:
        deepspeed_integration.unset_hf_deepspeed_config()
    refused = {line[len("- ds "):].split("=", 1)[0] for line in real.mismatches}
    assert {key for key, _, _ in transformers_mismatches(ds, training, world_size=1)} == refused


@settings(max_examples=200, deadline=None)
@given(stage=st.one_of(st.integers(-3, 6), st.booleans(), st.none(), st.floats(-1, 5), st.sampled_from([float("nan"), float("inf")]),
                       st.sampled_from(["3", "3.0", " 2", "2.5", "zero3", "", "1e0", "inf", "nan"]),
                       st.lists(st.integers(0, 3), max_size=1)))
def test_stage_reading_equals_deepspeeds(stage):
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config", reason="deepspeed is not installed")
    try:
        expected = int(zero_config.DeepSpeedZeroConfig(stage=stage).stage)
    except Exception:  # noqa: BLE001 - pydantic's ValidationError: DeepSpeed refuses the value
        expected = None
    assert deepspeed_stage(stage) == expected, (stage, expected)
    if isinstance(stage, float) and math.isnan(stage):
        assert expected is None


def test_a_path_to_nothing_is_left_to_the_launch_but_a_broken_link_is_refused(tmp_path):
    assert _report(tmp_path / "absent.json").ok  # validate may run where the run's files are not
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nowhere.json")
    assert any("symlink to a missing file" in t for t in _errors(_report(tmp_path / "dangling.json")))
