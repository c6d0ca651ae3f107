"""TrainingArguments pass-through combinations (issue 30 item 4): every value transformers, accelerate or torch
would refuse once training starts is refused before the model loads, at its dotted path (exit 2): at ``validate``
from the schema's table, machine-dependent ones (``tf32`` without an Ampere GPU) at ``preflight`` and ``train``.
The table cannot drift from transformers: a property test builds the REAL objects (``TrainingArguments`` through
``launch.training_arguments``, the Trainer's own checks, the DataLoader, accelerate's dynamo plugin) for every
combination and requires the schema to refuse exactly what they refuse."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.schema.contract import build_contract
from coordexp.schema.loader import validate_mapping

runner = CliRunner()

CASES = {
    "torch_compile_backend naming no backend": ({"torch_compile_backend": "nosuch"}, "training.torch_compile_backend"),
    "torch_compile with no backend": ({"torch_compile": True, "torch_compile_backend": "warp_drive"},
                                      "training.torch_compile_backend"),
    "eval_strategy steps without validation data": ({"eval_strategy": "steps"}, "training.eval_strategy"),
    "eval_strategy epoch without validation data": ({"eval_strategy": "epoch"}, "training.eval_strategy"),
    "save_strategy best without a metric": ({"save_strategy": "best"}, "training.save_strategy"),
    "prefetch without workers": ({"dataloader_prefetch_factor": 2}, "training.dataloader_prefetch_factor"),
    "persistent workers without workers": ({"dataloader_persistent_workers": True},
                                           "training.dataloader_persistent_workers"),
    "multiprocessing context without workers": ({"dataloader_multiprocessing_context": "spawn"},
                                                "training.dataloader_multiprocessing_context"),
    "multiprocessing context naming no start method": ({"dataloader_num_workers": 1,
                                                        "dataloader_multiprocessing_context": "threads"},
                                                       "training.dataloader_multiprocessing_context"),
    "fp16 and bf16 full eval": ({"fp16_full_eval": True, "bf16_full_eval": True}, "training.fp16_full_eval"),
}


@pytest.fixture
def tiny_config(tmp_path, tiny_model_dir, dataset):
    """``write(training_overrides)``: a stage-2 config on the tiny model without validation data."""
    from testkit import REPO

    def write(training: dict) -> str:
        config = {"extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"),
                  "model": {"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
                  "data": {"train_jsonl": str(dataset.train_jsonl), "val_jsonl": None},
                  "training": {"output_dir": str(tmp_path / "run"), "max_steps": 1, **training}}
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return str(path)

    return write


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model fails the test: every refusal here comes before it (patched where the launch looks it
    up, after importing the launch module, so no module keeps the refusing stand-in after the test)."""
    from coordexp.runtime.train import launch

    def refuse(*args, **kwargs):
        raise AssertionError("the model started loading although the training arguments are refused")

    monkeypatch.setattr(launch, "load_policy", refuse)


@pytest.mark.parametrize("case", list(CASES))
def test_validate_and_train_refuse_each_case_at_its_path(tiny_config, no_model, case):
    training, path = CASES[case]
    config = tiny_config(training)
    for command in ("validate", "train"):
        result = runner.invoke(app, [command, config])
        assert result.exit_code == 2, (command, result.output)
        assert path in result.output and "internal error" not in result.output, (command, result.output)


def test_tf32_is_judged_by_the_machine_at_preflight_and_train_not_at_validate(tiny_config, no_model):
    from transformers.utils import is_torch_tf32_available

    config = tiny_config({"tf32": True})
    assert runner.invoke(app, ["validate", config]).exit_code == 0  # a GPU node may well run it
    preflight = runner.invoke(app, ["preflight", config])
    train = runner.invoke(app, ["train", config])
    if is_torch_tf32_available():  # an Ampere or newer GPU here: tf32 is fine
        assert preflight.exit_code == 0, preflight.output
        return
    for result in (preflight, train):
        assert result.exit_code == 2, result.output
        assert "training.tf32" in result.output and "Ampere" in result.output, result.output


# --------------------------------------------------------------------- the table against the real objects

BASE_DATA = "data/val.jsonl"
COMBOS = st.fixed_dictionaries({}, optional={
    "dataloader_num_workers": st.sampled_from([0, 2]),
    "dataloader_prefetch_factor": st.sampled_from([None, 2]),
    "dataloader_persistent_workers": st.booleans(),
    "dataloader_multiprocessing_context": st.sampled_from([None, "spawn", "fork", "forkserver", "threads"]),
    "eval_strategy": st.sampled_from(["no", "steps", "epoch"]),
    "save_strategy": st.sampled_from(["no", "steps", "epoch", "best"]),
    "metric_for_best_model": st.sampled_from([None, "AP", "match_rate"]),
    "torch_compile": st.booleans(),
    "torch_compile_backend": st.sampled_from([None, "inductor", "EAGER", "aot_eager", "no", "nosuch"]),
    "fp16_full_eval": st.booleans(),
    "bf16_full_eval": st.booleans(),
})


def _real_refusals(stage2_config: dict, training: dict, with_val: bool) -> list:
    from coordexp.runtime.train.args_check import training_argument_issues

    base = copy.deepcopy(stage2_config)
    base["data"]["val_jsonl"] = BASE_DATA if with_val else None
    run = build_contract(validate_mapping(base).config)
    unchecked = run.training.model_copy(update=training)  # no schema validation: the real objects decide
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return training_argument_issues(dataclasses.replace(run, training=unchecked), machine=False)


@given(training=COMBOS, with_val=st.booleans())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_schema_refuses_exactly_what_transformers_refuses(stage2_config, training, with_val):
    config = copy.deepcopy(stage2_config)
    config["training"].update(training)
    config["data"]["val_jsonl"] = BASE_DATA if with_val else None
    report = validate_mapping(config)
    written = {f"training.{name}" for name in training}
    # coordexp's own rule, not transformers': save_strategy: best with no evaluation would never save (issue 37)
    schema_paths = {i.path for i in report.errors if "would write no checkpoint" not in i.message}
    real = _real_refusals(stage2_config, training, with_val)
    assert bool(schema_paths) == bool(real), (report.errors, real)
    assert schema_paths <= written and {i.path for i in real} <= written, (report.errors, real)  # a field written


@pytest.mark.parametrize("case", list(CASES))
def test_each_listed_case_is_refused_by_the_real_objects_too(stage2_config, case):
    """The cases the issue lists are real refusals, not the schema's opinion: transformers, accelerate or torch
    refuse each one, at the same path."""
    training, path = CASES[case]
    assert {i.path for i in _real_refusals(stage2_config, training, with_val=False)} == {path}


@pytest.mark.slow  # trains (a step with two worker processes)
def test_a_combination_both_accept_trains(tiny_config):
    config = tiny_config({"dataloader_num_workers": 1, "dataloader_persistent_workers": True,
                          "dataloader_prefetch_factor": 2, "dataloader_multiprocessing_context": "fork",
                          "save_strategy": "no"})
    result = runner.invoke(app, ["train", config, "--json"])
    assert result.exit_code == 0, result.output
