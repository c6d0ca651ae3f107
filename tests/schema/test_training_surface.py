"""``training.*`` as transformers' own ``TrainingArguments`` surface: the generated table matches the installed
transformers, every field is owned, passed through (typed and bounded) or refused with its reason, and the new
coordexp keys (part rates, scheduler floor, effective batch size, DeepSpeed) validate as documented."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.schema.contract import build_contract
from coordexp.schema.hf_surface import REFUSED
from coordexp.schema.hf_training_fields import HF_TRAINING_FIELDS
from coordexp.schema.loader import validate_mapping
from coordexp.schema.root import CoordExpConfig
from coordexp.schema.training import HF_PASSTHROUGH, TrainingConfig
from testkit import STAGE2_CONFIG
from testkit import REPO

NEW_KEYS = ("vit_lr", "aligner_lr", "vit_weight_decay", "aligner_weight_decay", "lr_scheduler_kwargs",
            "effective_batch_size", "deepspeed", "bf16", "eval_strategy", "save_only_model", "report_to")


def _errors(training: dict) -> list[tuple[str, str]]:
    config = {**STAGE2_CONFIG, "training": {**STAGE2_CONFIG["training"], **training}}
    return [(i.path, i.render()) for i in validate_mapping(config).errors]


def _training(training: dict):
    config = {**STAGE2_CONFIG, "training": {**STAGE2_CONFIG["training"], **training}}
    report = validate_mapping(config)
    assert report.ok, [i.render() for i in report.errors]
    return report.config


def test_generated_table_matches_installed_transformers():
    spec = importlib.util.spec_from_file_location("gen_hf", REPO / "scripts" / "gen_hf_training_fields.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = (REPO / "coordexp" / "schema" / "hf_training_fields.py").read_text(encoding="utf-8")
    assert module.render() == committed, "rerun .venv/bin/python scripts/gen_hf_training_fields.py"


def test_every_transformers_field_is_owned_passed_through_or_refused():
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    assert names <= set(TrainingConfig.model_fields)
    assert set(REFUSED) <= names  # no stale refusal
    assert {"bf16", "fp16", "eval_strategy", "save_strategy", "save_only_model", "metric_for_best_model",
            "greater_is_better", "logging_first_step", "run_name", "dataloader_drop_last", "dataloader_pin_memory",
            "dataloader_prefetch_factor", "dataloader_persistent_workers"} <= set(HF_PASSTHROUGH)


def test_passed_through_defaults_are_transformers_defaults():
    from transformers import TrainingArguments

    t = TrainingConfig(output_dir="/tmp/x")
    for name in HF_PASSTHROUGH:
        default = getattr(TrainingArguments, name, HF_TRAINING_FIELDS[name][2])
        default = getattr(default, "value", default)
        assert getattr(t, name) == default, name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_fields_fail_with_their_reason_even_as_null(name):
    for value in (True, None):
        errors = _errors({name: value})
        assert [p for p, _ in errors] == [f"training.{name}"]
        assert REFUSED[name][0] in errors[0][1]


def test_gradient_checkpointing_names_its_owner_and_unwritable_types_name_their_type():
    [(path, text)] = _errors({"gradient_checkpointing": True})
    assert path == "training.gradient_checkpointing" and "Set model.gradient_checkpointing instead" in text
    [(_, text)] = _errors({"fsdp_config": {"a": 1}})
    assert "FSDP is not supported yet" in text


def test_unknown_keys_still_fail_with_dotted_path_and_all_problems_at_once():
    errors = dict(_errors({"bogus_key": 1, "bf16": "yes", "use_cpu": True, "lr_scheduler_kwargs": {"min_lrr": 1}}))
    assert errors.keys() == {"training.bogus_key", "training.bf16", "training.use_cpu",
                             "training.lr_scheduler_kwargs.min_lrr"}
    assert "unknown key" in errors["training.bogus_key"]


def test_contract_and_schema_show_the_new_keys_and_hide_refused_ones():
    run = build_contract(_training({"vit_lr": 2e-5, "bf16": True, "report_to": "wandb"}))
    training = run.to_dict()["training"]  # what `coordexp validate --print-contract` prints
    assert set(NEW_KEYS) <= set(training)
    assert (training["vit_lr"], training["bf16"], training["report_to"]) == (2e-5, True, ["wandb"])
    assert not set(REFUSED) & set(training)
    properties = CoordExpConfig.model_json_schema()["$defs"]["TrainingConfig"]["properties"]
    assert set(NEW_KEYS) <= set(properties) and not set(REFUSED) & set(properties)


def test_report_to_takes_a_list_or_one_name(monkeypatch):
    assert _training({"report_to": "none"}).training.report_to == []
    assert _training({"report_to": ["none"]}).training.report_to == []  # upstream configs write the list form
    assert _training({"report_to": ["tensorboard", "wandb"]}).training.report_to == ["tensorboard", "wandb"]
    assert [p for p, _ in _errors({"report_to": ["slack"]})] == ["training.report_to[0]"]


def test_deepspeed_presets_paths_and_refusals(tmp_path):
    assert _training({"deepspeed": "zero3"}).training.deepspeed == "zero3"
    assert _training({"deepspeed": "./ds.json"}).training.deepspeed.endswith("/ds.json")  # resolved to absolute
    [(_, text)] = _errors({"deepspeed": "zero9"})
    assert "neither a preset (zero2, zero3) nor a path" in text
    [(_, text)] = _errors({"deepspeed": {"zero_optimization": {"stage": 2}}})
    assert "inline DeepSpeed dict is not supported" in text
    # multi-row packed micro-steps are correct under DeepSpeed (tests/e2e/test_deepspeed_torchrun.py)
    assert _training({"deepspeed": "zero2", "packing": True}).training.packing


def test_retired_transformers_keys():
    assert _training({"save_safetensors": True, "logging_dir": "/tmp/tb"}).training.logging_dir == "/tmp/tb"
    assert [p for p, _ in _errors({"save_safetensors": False})] == ["training.save_safetensors"]


@settings(max_examples=60, deadline=None)
@given(eff=st.integers(1, 512), per_device=st.integers(1, 16), accumulation=st.integers(1, 4))
def test_effective_batch_size_rules(eff, per_device, accumulation):
    errors = _errors({"effective_batch_size": eff, "per_device_train_batch_size": per_device,
                      "gradient_accumulation_steps": accumulation})
    expected = (accumulation != 1) + (eff % per_device != 0)
    assert [p for p, _ in errors] == ["training.effective_batch_size"] * expected


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["cosine_with_min_lr", "cosine", "linear"]),
       min_lr=st.one_of(st.none(), st.floats(-1.0, 20.0)), rate=st.one_of(st.none(), st.floats(-0.5, 1.5)))
def test_scheduler_floor_is_exactly_one_bounded_value_for_cosine_with_min_lr(kind, min_lr, rate):
    kwargs = {k: v for k, v in (("min_lr", min_lr), ("min_lr_rate", rate)) if v is not None}
    errors = _errors({"lr_scheduler_type": kind, "lr_scheduler_kwargs": kwargs, "learning_rate": 1.0})
    valid = (kind == "cosine_with_min_lr" and len(kwargs) == 1
             and (min_lr is None or 0.0 <= min_lr <= 1.0) and (rate is None or 0.0 <= rate <= 1.0))
    assert (errors == []) == valid, errors


@settings(max_examples=40, deadline=None)
@given(prefetch=st.integers(-5, 2000), timeout=st.integers(-5, 10**7), flag=st.sampled_from([True, 1, "true"]))
def test_passed_through_fields_are_typed_and_bounded(prefetch, timeout, flag):
    errors = dict(_errors({"dataloader_prefetch_factor": prefetch, "ddp_timeout": timeout, "bf16": flag,
                           "dataloader_num_workers": 1}))  # prefetching needs workers (issue 30 item 4)
    assert ("training.dataloader_prefetch_factor" in errors) == (not 1 <= prefetch <= 1024)
    assert ("training.ddp_timeout" in errors) == (not 1 <= timeout <= 7 * 24 * 3600)
    assert ("training.bf16" in errors) == (flag is not True)


@settings(max_examples=30, deadline=None)
@given(part=st.sampled_from(["vit_lr", "aligner_lr", "vit_weight_decay", "aligner_weight_decay"]),
       value=st.floats(-1.0, 20.0, allow_nan=False))
def test_part_rates_are_bounded(part, value):
    low_ok = value > 0 if part.endswith("_lr") else value >= 0
    assert (_errors({part: value}) == []) == (low_ok and value <= 10.0)


@pytest.mark.slow  # starts a process
def test_schema_import_stays_light():
    code = "import sys, coordexp.schema; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["AP50", "eval_AP50", "eval/AP50", "match_rate", "eval_segm_AP", "eval_token_acc",
                                  "coord_token_loss"])
def test_metric_for_best_model_names_a_figure_evaluation_reports(name):
    assert _training({"metric_for_best_model": name}).training.metric_for_best_model == name


@pytest.mark.parametrize("name", ["token_accuracy", "loss", "eval_loss", "rollout/f1", "eval_AP51"])
def test_a_metric_evaluation_never_reports_is_refused_naming_the_ones_it_does(name):
    # HF's best-model tracking would end the run at the first evaluation with a KeyError (exit 1)
    (path, text), = _errors({"metric_for_best_model": name})
    assert path == "training.metric_for_best_model" and repr(name) in text
    assert "AP50" in text and "match_rate" in text


def test_load_best_model_at_end_is_refused_with_the_reason():
    (path, text), = _errors({"load_best_model_at_end": True})
    assert path == "training.load_best_model_at_end" and "own loader" in text
