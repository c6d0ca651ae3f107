"""Per-part optimizer groups on a tiny Qwen3-VL (llm / vision / aligner rates, no decay for biases and norms),
the cosine_with_min_lr floor, effective_batch_size -> accumulation steps, DeepSpeed presets and preflight's
groups line."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from coordexp.errors import UserInputError
from coordexp.runtime.model.parts import model_part
from coordexp.schema.contract import load_contract
from coordexp.schema.loader import deep_merge
from testkit import REPO

RATES = {"llm": (1e-3, 0.1), "vision": (2e-4, 0.01), "aligner": (5e-3, 0.0)}


@pytest.fixture()
def qwen3_run(tmp_path, qwen3_model_dir, synthetic_dataset):
    """``run(overrides)`` -> the contract of a stage-1 config on the tiny Qwen3-VL, every part trainable."""

    def run(overrides: dict | None = None):
        config = {
            "extends": str(REPO / "examples" / "stage1_sft.yaml"),
            "model": {"path": str(qwen3_model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
            "data": {"train_jsonl": str(synthetic_dataset.train_jsonl), "val_jsonl": None},
            "tuner": {"freeze_vit": False, "freeze_aligner": False},
            "training": {"output_dir": str(tmp_path / "run"), "max_steps": 4, "learning_rate": RATES["llm"][0],
                         "weight_decay": RATES["llm"][1], "vit_lr": RATES["vision"][0],
                         "vit_weight_decay": RATES["vision"][1], "aligner_lr": RATES["aligner"][0],
                         "aligner_weight_decay": RATES["aligner"][1], "packing": False},
            "rollout_matching": {"rollout_backend": "hf"},
        }
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump(deep_merge(config, overrides or {})), encoding="utf-8")
        return load_contract(path)

    return run


@pytest.fixture(scope="module")
def qwen3_policy(qwen3_model_dir):
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.model.policy import load_processor

    return AutoModelForImageTextToText.from_pretrained(qwen3_model_dir), load_processor(str(qwen3_model_dir))


def _trainer(run, policy, trainable: set[str] | None = None):
    from coordexp.runtime.train.launch import build_trainer

    model, processor = policy
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(trainable is None or model_part(name) in trainable)
    return build_trainer(run, model=model, processor=processor)


def test_groups_carry_each_parts_rate_and_exactly_its_parameters(qwen3_run, qwen3_policy):
    trainer = _trainer(qwen3_run(), qwen3_policy)
    optimizer = trainer.create_optimizer()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    decay = set(trainer.get_decay_parameter_names(trainer.model))
    seen = []
    for group in optimizer.param_groups:
        lr, wd = RATES[group["part"]]
        assert group["lr"] == lr
        assert group["weight_decay"] == (wd if group["decay"] else 0.0)
        for p in group["params"]:
            name = names[id(p)]
            assert model_part(name) == group["part"]
            assert (name in decay) == group["decay"]
            seen.append(name)
    assert sorted(seen) == sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert {(g["part"], g["decay"]) for g in optimizer.param_groups} == {
        (part, decayed) for part in RATES for decayed in (True, False)}
    no_decay = [names[id(p)] for g in optimizer.param_groups if not g["decay"] for p in g["params"]]
    assert any(n.endswith(".bias") for n in no_decay) and any("norm" in n for n in no_decay)
    assert any("deepstack_merger_list" in n for g in optimizer.param_groups if g["part"] == "aligner"
               for n in (names[id(p)] for p in g["params"]))


def test_frozen_parts_have_no_group_and_null_rates_fall_back(qwen3_run, qwen3_policy):
    run = qwen3_run({"training": {"vit_lr": None, "aligner_lr": None, "vit_weight_decay": None}})
    trainer = _trainer(run, qwen3_policy, trainable={"llm", "vision"})
    groups = trainer.create_optimizer().param_groups
    assert {g["part"] for g in groups} == {"llm", "vision"}  # the frozen aligner's groups are omitted
    vision = next(g for g in groups if g["part"] == "vision" and g["decay"])
    assert (vision["lr"], vision["weight_decay"]) == RATES["llm"]
    assert all(p.requires_grad for g in groups for p in g["params"])


def test_optim_sgd_still_chosen_by_training_optim(qwen3_run, qwen3_policy):
    import torch

    trainer = _trainer(qwen3_run({"training": {"optim": "sgd"}}), qwen3_policy)
    assert isinstance(trainer.create_optimizer(), torch.optim.SGD)


@pytest.mark.parametrize("floor", [{"min_lr": 1e-4}, {"min_lr_rate": 0.25}])
def test_cosine_with_min_lr_reaches_its_floor_in_every_group(qwen3_run, qwen3_policy, floor):
    steps = 6
    run = qwen3_run({"training": {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": floor,
                                  "max_steps": steps}})
    trainer = _trainer(run, qwen3_policy)
    trainer.create_optimizer_and_scheduler(num_training_steps=steps)
    for _ in range(steps):
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    rate = floor.get("min_lr_rate", floor.get("min_lr", 0.0) / RATES["llm"][0])
    for group in trainer.optimizer.param_groups:
        assert math.isclose(group["lr"], RATES[group["part"]][0] * rate, rel_tol=1e-9)
    llm = next(g for g in trainer.optimizer.param_groups if g["part"] == "llm")
    assert math.isclose(llm["lr"], floor.get("min_lr", RATES["llm"][0] * rate), rel_tol=1e-9)


@pytest.mark.parametrize("world_size, expected", [(1, 8), (2, 4)])
def test_effective_batch_size_resolves_accumulation_from_world_size(qwen3_run, monkeypatch, world_size, expected):
    from coordexp.runtime.train.launch import training_arguments

    run = qwen3_run({"training": {"effective_batch_size": 16, "per_device_train_batch_size": 2,
                                  "gradient_accumulation_steps": 1}})
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    if world_size == 1:
        assert training_arguments(run).gradient_accumulation_steps == expected
    else:  # building TrainingArguments for 2 ranks would need a process group: check the resolution itself
        from coordexp.runtime.train import launch

        assert launch.accumulation_steps(run.training, world_size) == expected


def test_effective_batch_size_that_does_not_divide_exits_2(qwen3_run, monkeypatch):
    from coordexp.errors import EXIT_INVALID, exit_code_for
    from coordexp.runtime.train.launch import training_arguments

    run = qwen3_run({"training": {"effective_batch_size": 6, "per_device_train_batch_size": 2,
                                  "gradient_accumulation_steps": 1}})
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserInputError, match=r"effective_batch_size \(6\).*WORLD_SIZE \(2\)") as info:
        training_arguments(run)
    assert exit_code_for(info.value) == EXIT_INVALID


def test_passed_through_fields_reach_training_arguments(qwen3_run, tmp_path, monkeypatch):
    from coordexp.runtime.train.launch import training_arguments

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    run = qwen3_run({"training": {"dataloader_drop_last": True, "logging_first_step": True, "run_name": "r1",
                                  "save_only_model": True, "save_strategy": "epoch",
                                  "metric_for_best_model": "eval/fp_per_image", "greater_is_better": False, "dataloader_pin_memory": False, "warmup_steps": 3, "warmup_ratio": 0.0,
                                  "logging_dir": "./tb", "report_to": ["tensorboard"]}})
    args = training_arguments(run)
    assert (args.dataloader_drop_last, args.logging_first_step, args.run_name, args.save_only_model) == (
        True, True, "r1", True)
    # HF reads eval_<name>: the evaluation's eval/<name> spelling is passed in that form
    assert (args.save_strategy, args.metric_for_best_model, args.greater_is_better) == (
        "epoch", "eval_fp_per_image", False)
    assert (args.dataloader_pin_memory, args.warmup_steps, args.report_to) == (False, 3, ["tensorboard"])
    assert (args.remove_unused_columns, args.disable_tqdm, args.ddp_find_unused_parameters) == (False, True, False)
    import os

    assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "tb")


def test_deepspeed_presets_resolve_to_packaged_json():
    from coordexp.runtime.train.deepspeed import preset_names, resolve_deepspeed
    from coordexp.schema.training import DEEPSPEED_PRESETS

    assert preset_names() == DEEPSPEED_PRESETS
    for stage, name in ((2, "zero2"), (3, "zero3")):
        config = json.loads(open(resolve_deepspeed(name), encoding="utf-8").read())
        assert config["zero_optimization"]["stage"] == stage
        assert config["train_micro_batch_size_per_gpu"] == "auto"
        assert "optimizer" not in config and "scheduler" not in config  # coordexp's groups and schedule are used
    assert resolve_deepspeed(None) is None
    with pytest.raises(UserInputError, match="not a file"):
        resolve_deepspeed("/nonexistent/ds.json")
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert "runtime/train/deepspeed/*.json" in text  # shipped in the wheel


def test_preflight_prints_groups_with_checkpoint_parameter_counts(qwen3_run, qwen3_policy):
    from coordexp.runtime.train.preflight import optimizer_groups_detail

    model, _ = qwen3_policy
    counts = {part: 0 for part in RATES}
    for name, parameter in model.named_parameters():
        counts[model_part(name)] += parameter.numel()
    detail = optimizer_groups_detail(qwen3_run())
    for part, (lr, wd) in RATES.items():
        assert f"{part}: lr {lr:g}, weight_decay {wd:g}, {counts[part]:,} params" in detail
    frozen = optimizer_groups_detail(qwen3_run({"tuner": {"freeze_vit": True}}))
    assert "vision: frozen" in frozen


@pytest.mark.slow
def test_short_stage1_run_trains_with_part_rates(qwen3_run, qwen3_policy):
    run = qwen3_run({"training": {"max_steps": 2, "lr_scheduler_type": "constant", "logging_steps": 1,
                                  "save_steps": 1000}})
    trainer = _trainer(run, qwen3_policy)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    assert {g["part"]: g["lr"] for g in trainer.optimizer.param_groups} == {p: r[0] for p, r in RATES.items()}
    moved = {model_part(n) for n, p in trainer.model.named_parameters() if not p.detach().equal(before[n])}
    assert moved == set(RATES)
