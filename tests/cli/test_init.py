"""``coordexp init``: every (stage x device) config validates as written, is self-contained and commented, follows
the checkpoint's family and the hardware, and nothing is ever overwritten. Training it end to end is
tests/e2e/test_quickstart.py (the README's quickstart)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.cli.init import STAGE1_LR, STAGE2_LR, InitChoices, render_config
from coordexp.schema.loader import validate_config_file

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def _fake_checkpoint(folder: Path, family: str, coord_tokens: bool = True) -> Path:
    """A folder that init reads as a checkpoint: init reads config.json and the tokenizer's text, never weights."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": family}))
    (folder / "tokenizer.json").write_text(json.dumps({"added_tokens": ["<|coord_999|>"] if coord_tokens else []}))
    return folder


@pytest.fixture()
def project(tmp_path):
    """A user's folder: a qwen2_vl checkpoint and converted train/val records."""
    _fake_checkpoint(tmp_path / "model", "qwen2_vl")
    (tmp_path / "data").mkdir()
    for name in ("train.jsonl", "val.jsonl"):
        (tmp_path / "data" / name).write_text("")
    return tmp_path


def _init(project: Path, name: str, *extra):
    return _run("init", "-o", project / name, "--model", project / "model", "--train-jsonl",
                project / "data" / "train.jsonl", *extra)


@pytest.mark.parametrize("stage", ["1", "2"])
@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_every_stage_and_device_validates_as_written(project, stage, device):
    result = _init(project, "cfg.yaml", "--val-jsonl", project / "data" / "val.jsonl", "--stage", stage,
                   "--device", device)
    assert result.exit_code == 0, result.output
    path = project / "cfg.yaml"
    report = validate_config_file(path)
    assert report.ok and report.warnings == (), [i.render() for i in (*report.errors, *report.warnings)]
    assert _run("validate", path).exit_code == 0
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    assert "extends" not in data
    assert max(len(line) for line in text.splitlines()) <= 120
    assert text.count("\n# ") >= 7 and text.count("  # ") >= 30  # every block and key says what it is
    variant = {"1": "stage1_sft", "2": "stage2_rollout_aligned"}[stage]
    assert data["custom"]["trainer_variant"] == variant
    assert data["model"]["path"] == "./model" and data["data"]["val_jsonl"] == "./data/val.jsonl"
    assert data["training"]["output_dir"] == "./runs/cfg" and data["training"]["eval_steps"] > 0
    assert data["training"]["learning_rate"] == (STAGE2_LR if stage == "2" else STAGE1_LR)[device]
    contract = report.config
    if device == "cpu":
        assert (contract.model.dtype, contract.model.attn_implementation) == ("float32", "sdpa")
        assert contract.rollout_matching.rollout_backend == "hf"
    else:
        assert contract.model.dtype == "bfloat16"
        assert contract.model.attn_implementation in ("flash_attention_2", "sdpa")
        backend = contract.rollout_matching.rollout_backend
        assert backend == ("vllm" if stage == "2" else "hf")
    if stage == "2":  # the recipe of docs/design.md, decisions 15 and 16
        rm = contract.rollout_matching
        assert (rm.gt_step_share, rm.trailing_unmatched, rm.decoding.coord_group_greedy) == (0.5, "drop", True)
        # the placement and repeat keys are written out (issue 41), with what the measurements support
        assert data["rollout_matching"]["fn_placement"] == "append" and data["rollout_matching"]["repeats"] == "neutral"
        assert (rm.fn_placement, rm.repeats) == ("append", "neutral")
        assert contract.training.packing is True
        if device == "gpu":
            assert (rm.vllm.mode, rm.vllm.tensor_parallel_size) == ("colocate", 1)


def test_values_not_chosen_are_the_schema_defaults():
    """The file is generated from the schema: change a default there and init writes the new one."""
    from coordexp.schema.rollout import RepeatTerminateConfig, RolloutMatchingConfig
    from coordexp.schema.template import TemplateConfig

    choices = InitChoices(model="./m", train_jsonl="./t.jsonl", val_jsonl=None, output_dir="./runs/x", stage=2,
                          device="gpu", family="qwen2_vl")
    data = yaml.safe_load(render_config(choices))
    assert data["template"]["max_pixels"] == TemplateConfig().max_pixels
    assert data["template"]["system_prompt"] == TemplateConfig().system_prompt
    assert data["rollout_matching"]["max_new_tokens"] == RolloutMatchingConfig().max_new_tokens
    assert data["rollout_matching"]["repeat_terminate"]["min_new_tokens"] == RepeatTerminateConfig().min_new_tokens
    assert data["training"]["eval_steps"] is None and data["data"]["val_jsonl"] is None


def test_flash_attention_on_gpu_only_where_the_package_is_installed(project, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else
                        real(name, *a))
    assert _init(project, "gpu.yaml", "--device", "gpu").exit_code == 0
    assert _init(project, "cpu.yaml", "--device", "cpu").exit_code == 0
    assert yaml.safe_load((project / "gpu.yaml").read_text())["model"]["attn_implementation"] == "flash_attention_2"
    assert yaml.safe_load((project / "cpu.yaml").read_text())["model"]["attn_implementation"] == "sdpa"


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_family_is_read_from_the_checkpoint(tmp_path, family):
    _fake_checkpoint(tmp_path / "ckpt", family)
    (tmp_path / "train.jsonl").write_text("")
    result = _run("init", "-o", tmp_path / "c.yaml", "--model", tmp_path / "ckpt", "--train-jsonl",
                  tmp_path / "train.jsonl", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert f"for a {family} model" in (tmp_path / "c.yaml").read_text()


def test_an_existing_file_is_never_overwritten(project):
    target = project / "cfg.yaml"
    target.write_text("mine\n")
    result = _init(project, "cfg.yaml")
    assert result.exit_code == 2
    assert "already exists" in result.stderr and "✗" in result.stderr
    assert target.read_text() == "mine\n"


@pytest.mark.parametrize("case, expected", [
    ("no-checkpoint", "is not a checkpoint folder"),
    ("unsupported-family", "is not a supported Qwen-VL family"),
    ("missing-train", "--train-jsonl"),
    ("bad-device", "--device"),
])
def test_bad_input_exits_2_and_writes_nothing(project, case, expected):
    args = ["init", "-o", project / "cfg.yaml", "--model", project / "model", "--train-jsonl",
            project / "data" / "train.jsonl"]
    if case == "no-checkpoint":
        args[4] = project / "nowhere"
    elif case == "unsupported-family":
        args[4] = _fake_checkpoint(project / "llama", "llama")
    elif case == "missing-train":
        args[6] = project / "data" / "missing.jsonl"
    else:
        args += ["--device", "tpu"]
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.stderr.split())
    assert not (project / "cfg.yaml").exists()


def test_stage2_without_a_trained_stage1_says_to_train_it_first(project):
    result = _run("init", "-o", project / "s2.yaml", "--stage", "2", "--model", project / "runs" / "stage1",
                  "--train-jsonl", project / "data" / "train.jsonl")
    assert result.exit_code == 2
    assert "Train stage 1 first" in " ".join(result.stderr.split())


def test_a_checkpoint_without_coord_tokens_gets_the_expand_vocab_hint(tmp_path):
    _fake_checkpoint(tmp_path / "base", "qwen2_5_vl", coord_tokens=False)
    (tmp_path / "train.jsonl").write_text("")
    result = _run("init", "-o", tmp_path / "c.yaml", "--model", tmp_path / "base", "--train-jsonl",
                  tmp_path / "train.jsonl")
    assert result.exit_code == 0
    assert "coordexp expand-vocab" in " ".join(result.stdout.split())


def test_paths_far_from_the_config_are_written_absolute(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    _fake_checkpoint(tmp_path / "model", "qwen2_vl")
    (tmp_path / "train.jsonl").write_text("")
    result = _run("init", "-o", deep / "c.yaml", "--model", tmp_path / "model", "--train-jsonl",
                  tmp_path / "train.jsonl")
    assert result.exit_code == 0, result.output
    data = yaml.safe_load((deep / "c.yaml").read_text())
    assert data["model"]["path"] == str(tmp_path / "model")
    assert validate_config_file(deep / "c.yaml").ok


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_DATA = {"model": "../.coordexp/tiny-model", "train_jsonl": "../.coordexp/demo-data/train.jsonl",
                "val_jsonl": "../.coordexp/demo-data/val.jsonl", "family": "qwen2_vl"}
EXAMPLE_CHOICES = {
    f"stage{stage}_{suffix}.yaml": InitChoices(
        **{**EXAMPLE_DATA, "model": EXAMPLE_DATA["model"] if stage == 1 else f"../.coordexp/runs/stage1_{suffix}"},
        output_dir=f"../.coordexp/runs/stage{stage}_{suffix}", stage=stage, device=device)
    for stage in (1, 2) for device, suffix in (("cpu", "cpu"), ("gpu", "1gpu"))
}


@pytest.mark.parametrize("name", sorted(EXAMPLE_CHOICES))
def test_the_runnable_examples_are_what_init_writes(name):
    """examples/stage{1,2}_{cpu,1gpu}.yaml cannot drift from init (nor from the schema's defaults): each is a comment
    saying where its tiny model and data come from, then exactly init's output for those paths.
    COORDEXP_REGENERATE_EXAMPLES=1 rewrites their generated part."""
    import os

    path = EXAMPLES / name
    text = path.read_text(encoding="utf-8")
    rendered = render_config(EXAMPLE_CHOICES[name])
    if os.environ.get("COORDEXP_REGENERATE_EXAMPLES") == "1":
        head = text[: text.find("# coordexp stage")] if "# coordexp stage" in text else text
        path.write_text(head + rendered, encoding="utf-8")
        text = head + rendered
    head, generated = text[: len(text) - len(rendered)], text[len(text) - len(rendered):]
    assert generated == rendered
    assert head and all(line.startswith("#") for line in head.splitlines())
    assert "make-tiny-model" in head


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_the_reward_objective_config_is_complete_commented_and_validates(project, device):
    """``--objective reward`` (issue 52): the reward objective with every rollout_matching.reward key written out at
    the schema's default, each with its description, and decoding that samples the policy's own distribution."""
    from coordexp.schema.rollout import RewardConfig

    result = _init(project, "rw.yaml", "--stage", "2", "--device", device, "--objective", "reward")
    assert result.exit_code == 0, result.output
    path = project / "rw.yaml"
    report = validate_config_file(path)
    assert report.ok and report.warnings == (), [i.render() for i in (*report.errors, *report.warnings)]
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    rm = data["rollout_matching"]
    assert rm["objective"] == "reward" and rm["decoding"]["temperature"] == 1.0
    assert rm["reward"] == RewardConfig().model_dump(mode="json")  # complete: every key, at its default
    for field in RewardConfig.model_fields.values():
        assert field.description.split(";")[0].split(",")[0][:30] in " ".join(text.split()), field.description
    assert text.startswith("# coordexp stage 2 (the reward objective)")
    assert report.config.rollout_matching.objective == "reward"


def test_the_reward_objective_is_refused_for_stage_1_and_an_unknown_objective_is_exit_2(project):
    assert _init(project, "a.yaml", "--objective", "reward").exit_code == 2
    assert _init(project, "b.yaml", "--stage", "2", "--objective", "rl").exit_code == 2
    assert not (project / "a.yaml").exists() and not (project / "b.yaml").exists()
