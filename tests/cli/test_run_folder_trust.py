"""Run folders you can trust (issue 43) and a run that never writes over a user's files (issue 45): the foreign
folder and file refusals, ``--overwrite`` apart from the model and moving the old run aside whole, ``--set`` read
like the file, the run record (what the user wrote, secrets masked, header unbreakable), resume replaying the
recorded overrides, non-finite weights refused, ``plot-run``'s bounded reader and ``eval``'s result folders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def _config(root: Path, model: Path, *, lora: bool = False, output_dir: str = "./run", **training) -> Path:
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    if not (root / "data").is_dir():
        write_synthetic_dataset(root / "data", n_train=4, n_val=2, seed=0)
    data = {
        "extends": str(EXAMPLES / "demo_stage2.yaml"),
        "global_max_length": 2048,
        "custom": {"trainer_variant": "stage1_sft"},
        "model": {"path": str(model)},
        "data": {"train_jsonl": "./data/train.jsonl", "val_jsonl": None},
        "training": {"output_dir": output_dir, "max_steps": 1, "logging_steps": 1,
                     "per_device_train_batch_size": 2, "packing": False, **training},
    }
    if lora:
        data["tuner"] = {"train_type": "lora", "lora_rank": 4, "lora_alpha": 8}
    path = root / "stage1.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# -- issue 45: a run never writes over a user's files ---------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True])
def test_a_folder_holding_a_users_readme_is_refused_and_left_byte_identical(tmp_path, tiny_model_dir, lora):
    pytest.importorskip("peft")
    target = tmp_path / "repo"
    target.mkdir()
    (target / "README.md").write_text("# my project\n", encoding="utf-8")
    (target / "config.json").write_text('{"mine": true}', encoding="utf-8")
    before = _digest(target)
    config = _config(tmp_path, tiny_model_dir, lora=lora, output_dir=str(target))
    result = _run("train", str(config))
    assert result.exit_code == 2, result.output
    assert "no coordexp run wrote" in result.output and "README.md" in result.output
    assert _digest(target) == before and sorted(os.listdir(target)) == ["README.md", "config.json"]


def test_a_user_config_named_like_the_record_in_its_output_folder_is_not_replaced(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir, output_dir=".")
    inside = tmp_path / "coordexp_config.yaml"
    shutil.move(config, inside)
    before = inside.read_bytes()
    result = _run("train", str(inside))
    assert result.exit_code == 2 and inside.read_bytes() == before


@pytest.mark.parametrize("kind", ["file", "under_file", "loop", "devnull", "long"])
def test_output_dir_that_is_no_folder_exits_2(tmp_path, tiny_model_dir, kind):
    (tmp_path / "plain").write_text("x")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    where = {"file": tmp_path / "plain", "under_file": tmp_path / "plain" / "run", "loop": tmp_path / "loop",
             "devnull": Path("/dev/null"), "long": tmp_path / ("x" * 300)}[kind]
    config = _config(tmp_path, tiny_model_dir, output_dir=str(where))
    result = _run("train", str(config))
    assert result.exit_code == 2, result.output
    assert "training.output_dir" in result.output and "Traceback" not in result.output
    assert (tmp_path / "plain").read_text() == "x"


# -- issue 43: --overwrite apart from the model; only checkpoint-<digits> ------------------------------------------


@pytest.mark.parametrize("overwrite", [True, False])
def test_output_dir_equal_to_model_path_is_refused_without_looping_advice(tmp_path, tiny_model_dir, overwrite):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    from coordexp.runtime.train.run_folder import RECORD_MARK

    (model / "coordexp_config.yaml").write_text(f"{RECORD_MARK}: stage 1's run\n")  # model.path is a run folder
    (model / "checkpoint-3").mkdir()
    before = _digest(model)
    config = _config(tmp_path, model, output_dir=str(model))
    result = _run("train", str(config), *(["--overwrite"] if overwrite else []))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "model.path" in text and "--overwrite" not in text and "--resume" not in text
    assert _digest(model) == before
    inside = _config(tmp_path, model, output_dir=str(model / "sub"))
    assert _run("train", str(inside)).exit_code == 2  # inside model.path, too


def test_only_checkpoint_digits_folders_count_and_overwrite_moves_a_run_aside_whole(tmp_path):
    from coordexp.runtime.train.run_folder import (RECORD_MARK, foreign_entries, move_previous_run,
                                                   used_output_problem)

    run = tmp_path / "run"
    (run / "checkpoint-tools").mkdir(parents=True)
    (run / "checkpoint-tools" / "tool.py").write_text("print(1)")
    assert used_output_problem(run) is None
    (run / "coordexp_config.yaml").write_text(f"{RECORD_MARK}\n")
    (run / "checkpoint-2").mkdir()
    (run / "model.safetensors").write_bytes(b"weights")
    (run / "eval_val").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    os.symlink(outside, run / "checkpoint-9")  # a linked checkpoint: the link moves, its target is untouched
    assert "checkpoint-2" in used_output_problem(run) and foreign_entries(run) == []
    target, moved = move_previous_run(run, now=0)
    assert target == run / ".previous" / "19700101T000000Z"
    assert sorted(moved) == ["checkpoint-2", "checkpoint-9", "coordexp_config.yaml", "eval_val",
                             "model.safetensors"]
    assert sorted(os.listdir(run)) == [".previous", "checkpoint-tools"]
    assert (run / "checkpoint-tools" / "tool.py").read_text() == "print(1)"
    assert os.path.islink(target / "checkpoint-9") and (outside / "keep.txt").read_text() == "keep"
    assert move_previous_run(run, now=0) is None  # nothing left to move


def test_overwrite_changes_nothing_when_the_new_run_cannot_start(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir, output_dir="./run")
    run = tmp_path / "run"
    from coordexp.runtime.train.run_folder import RECORD_MARK

    run.mkdir()
    (run / "coordexp_config.yaml").write_text(f"{RECORD_MARK}\nold: record\n")
    (run / "checkpoint-1").mkdir()
    (run / "checkpoint-1" / "trainer_state.json").write_text('{"global_step": 1}')
    before = _digest(run)
    (tmp_path / "data" / "train.jsonl").write_text('{"broken": \n')  # the new run's data cannot load
    result = _run("train", str(config), "--overwrite")
    assert result.exit_code == 2, result.output
    assert _digest(run) == before and not (run / ".previous").exists()


# -- --set read like the file; the record -----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "value"), [("2e-5", 2e-5), ("010", 10), ("on", "on"), ("no", "no"),
                                             ("0x1F", 31), ("1:30", "1:30"), ("true", True), ("null", None)])
def test_set_values_are_read_as_yaml_1_2(text, value):
    from coordexp.cli.overrides import parse_override

    assert parse_override(f"training.x={text}").value == value


_BOMB = "[&a0 [x,x,x,x,x,x,x,x,x], " + ", ".join(
    f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)) + "]"  # 9**9 nodes once expanded


@pytest.mark.parametrize("bad", ["a=&x [*x]", "a=" + "9" * 5000, "a=" + "[" * 200, "a=" + _BOMB])
def test_set_values_are_bounded_like_file_values(bad):
    from coordexp.cli.overrides import parse_override
    from coordexp.errors import UserInputError

    started = time.monotonic()
    with pytest.raises(UserInputError):
        parse_override(bad)
    assert time.monotonic() - started < 5


def test_a_superscript_list_index_is_a_clear_refusal():
    from coordexp.cli.overrides import apply_overrides
    from coordexp.errors import UserInputError
    from coordexp.schema.loader import MergedConfig

    merged = MergedConfig({"a": [1, 2]}, {("a",): "f.yaml"}, ("f.yaml",))
    with pytest.raises(UserInputError):
        apply_overrides(merged, ["a.\u00b2=1"])


def test_set_learning_rate_2e_5_validates(tmp_path, tiny_model_dir):
    from coordexp.cli.frame import load_run_and_config

    config = _config(tmp_path, tiny_model_dir)
    run, _ = load_run_and_config(config, overrides=["training.learning_rate=2e-5"])
    assert run.training.learning_rate == pytest.approx(2e-5)


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=0, max_size=40))
def test_no_override_value_breaks_out_of_the_record_header(tmp_path_factory, value):
    from coordexp.cli.overrides import recorded_overrides, write_run_record
    from coordexp.schema.loader import MergedConfig
    from coordexp.schema.yaml_io import parse_yaml_text

    folder = tmp_path_factory.mktemp("record")
    text = f"training.note={value}"
    merged = MergedConfig({"training": {"max_steps": 1}}, {("training",): "f.yaml"}, ("f.yaml",))
    record = write_run_record(folder, merged, source=folder / "cfg.yaml", overrides=[text])
    assert parse_yaml_text(record.read_text(encoding="utf-8")) == {"training": {"max_steps": 1}}
    assert recorded_overrides(folder) == [text]


def test_secrets_are_masked_in_header_and_body_and_refused_if_reused(tmp_path):
    from coordexp.cli.overrides import SECRET_MASK, recorded_overrides, write_run_record
    from coordexp.schema.loader import MergedConfig, validate_mapping

    secret = "s3cr3t-token-value"
    merged = MergedConfig({"rollout_matching": {"vllm": {"server": {"sync_token": secret}}}}, {}, ("f.yaml",))
    record = write_run_record(tmp_path, merged, source=tmp_path / "c.yaml",
                              overrides=[f"rollout_matching.vllm.server.sync_token={secret}"])
    text = record.read_text()
    assert secret not in text and SECRET_MASK in text
    assert recorded_overrides(tmp_path) == []  # a masked override is never replayed
    report = validate_mapping({"rollout_matching": {"vllm": {"server": {"sync_token": SECRET_MASK}}}})
    assert any("sync_token" in issue.path for issue in report.errors)


def test_the_record_holds_what_was_written_and_gives_the_same_contract(tmp_path, tiny_model_dir):
    """init's stage-1 recipe (evaluation, warmup) retrained from its record: the same training arguments."""
    from coordexp.cli.frame import load_run_and_config
    from coordexp.cli.overrides import apply_overrides, write_run_record
    from coordexp.runtime.train.launch import training_arguments
    from coordexp.schema.loader import load_merged

    config = _init_stage1(tmp_path, tiny_model_dir)
    sets = ["training.max_steps=6"]
    original, _ = load_run_and_config(config, overrides=sets)
    assert original.training.eval_steps is not None
    folder = tmp_path / "run_dir"
    record = write_run_record(folder, apply_overrides(load_merged(config), sets), source=config, overrides=sets)
    body = yaml.safe_load(record.read_text())
    assert "adam_beta2" not in body["training"]  # defaults are not written out
    again, _ = load_run_and_config(record, overrides=[f"training.output_dir={original.training.output_dir}"])
    first, second = training_arguments(original), training_arguments(again)
    for name in ("eval_strategy", "eval_steps", "warmup_steps", "max_steps", "learning_rate", "save_steps"):
        assert getattr(first, name) == getattr(second, name), name
    assert first.eval_strategy != "no" and first.warmup_steps == second.warmup_steps
    assert again.to_dict() == original.to_dict()


# -- non-finite weights, plot-run, eval folders --------------------------------------------------------------------


def test_train_from_all_nan_weights_exits_2_without_writing_a_model(tmp_path, tiny_model_dir):
    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "nan_model"
    shutil.copytree(tiny_model_dir, model)
    weights = load_file(str(model / "model.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in weights.items()},
              str(model / "model.safetensors"), metadata={"format": "pt"})
    config = _config(tmp_path, model)
    result = _run("train", str(config))
    assert result.exit_code == 2, result.output
    assert "non-finite" in result.output
    run = tmp_path / "run"
    assert not any((run / name).exists() for name in ("model.safetensors", "checkpoint-1", "coordexp_config.yaml"))


def test_plot_run_of_a_deep_trainer_state_exits_2(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "trainer_state.json").write_text("[" * 100_000 + "]" * 100_000)
    result = _run("plot-run", str(run))
    assert result.exit_code == 2, result.output


def test_plot_run_never_writes_through_a_link_onto_its_input(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    state = {"log_history": [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 10 ** 400}]}
    (run / "trainer_state.json").write_text(json.dumps(state))
    before = (run / "trainer_state.json").read_bytes()
    os.symlink(run / "trainer_state.json", tmp_path / "out.png")
    assert _run("plot-run", str(run), "--out", str(tmp_path / "out.png")).exit_code == 2
    assert (run / "trainer_state.json").read_bytes() == before
    assert _run("plot-run", str(run), "--out", str(tmp_path / "curves.nosuchformat")).exit_code == 2
    assert _run("plot-run", str(run)).exit_code == 0  # the 400-digit figure is left out, not an overflow


def test_eval_result_folders_of_different_checkpoints_never_collide(tmp_path):
    from types import SimpleNamespace

    from coordexp.cli.evaluate import default_out_dir

    out = tmp_path / "out"
    run = SimpleNamespace(training=SimpleNamespace(output_dir=str(out)))
    for folder in (out / "checkpoint-2", tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2",
                   tmp_path / "val", tmp_path / "x", tmp_path / "x_train", tmp_path / ("n" * 250)):
        folder.mkdir(parents=True)
    assert default_out_dir(run, out / "checkpoint-2", "val") == out / "eval_checkpoint-2"
    names = [default_out_dir(run, tmp_path / "a" / "checkpoint-2", "val"),
             default_out_dir(run, tmp_path / "b" / "checkpoint-2", "val"),
             default_out_dir(run, out / "checkpoint-2", "val"), default_out_dir(run, None, "val"),
             default_out_dir(run, tmp_path / "val", "val"), default_out_dir(run, tmp_path / "x", "train"),
             default_out_dir(run, tmp_path / "x_train", "val"), default_out_dir(run, out / "checkpoint-2", "train")]
    assert len(set(names)) == len(names)
    assert len(default_out_dir(run, tmp_path / ("n" * 250), "train").name.encode()) < 200


# -- end to end (train) ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # trains twice
def test_full_then_lora_with_overwrite_leaves_the_lora_run_for_eval(tmp_path, tiny_model_dir):
    pytest.importorskip("peft")
    from coordexp.cli.evaluate import run_with_checkpoint
    from coordexp.cli.frame import load_run_and_config

    config = _config(tmp_path, tiny_model_dir, save_steps=1)
    first = _run("train", str(config))
    assert first.exit_code == 0, first.output
    run = tmp_path / "run"
    assert (run / "model.safetensors").is_file()
    (run / "checkpoint-tools").mkdir()
    (run / "checkpoint-tools" / "notes.txt").write_text("mine")
    lora = _config(tmp_path, tiny_model_dir, lora=True, save_steps=1)
    second = _run("train", str(lora), "--overwrite")
    assert second.exit_code == 0, second.output
    assert (run / "checkpoint-tools" / "notes.txt").read_text() == "mine"
    assert not (run / "model.safetensors").exists() and (run / "adapter_model.safetensors").is_file()
    previous = list((run / ".previous").iterdir())
    assert len(previous) == 1 and (previous[0] / "model.safetensors").is_file()
    assert (previous[0] / "checkpoint-1").is_dir() and (previous[0] / "coordexp_config.yaml").is_file()
    loaded, _ = load_run_and_config(lora)
    _, model_dir, adapter = run_with_checkpoint(loaded, None)
    assert adapter is not None and adapter.resolve() == run.resolve()  # eval of OUTPUT_DIR: the LoRA run
    assert model_dir.resolve() == Path(tiny_model_dir).resolve()


@pytest.mark.slow  # trains
def test_resume_auto_replays_the_recorded_overrides_and_appends_to_the_record(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir, save_steps=1)  # the file says max_steps 1
    sets = ["--set", "training.max_steps=3", "--set", "training.learning_rate=2e-5"]
    result = _run("train", str(config), *sets)
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    for name in ("checkpoint-2", "checkpoint-3"):  # as if the run had been stopped after checkpoint-1
        shutil.rmtree(run / name)
    for path in run.iterdir():
        if path.is_file() and path.name != "coordexp_config.yaml":
            path.unlink()
    record_before = (run / "coordexp_config.yaml").read_text()
    resumed = _run("train", str(config), "--resume", "auto", "--json")
    assert resumed.exit_code == 0, resumed.output
    summary = json.loads(resumed.stdout[resumed.stdout.index("{"):])
    assert summary["global_step"] == 3  # the recorded max_steps, not the file's 1
    record = (run / "coordexp_config.yaml").read_text()
    assert record.startswith(record_before) and "# resumed at" in record


def _sigint_as_in_a_terminal() -> None:
    """The child gets Ctrl-C's default disposition: a suite started as a background job (`cmd &` in a script)
    inherits SIGINT ignored, which coordexp rightly leaves alone, and the SIGINT case would then test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # starts a training process
@pytest.mark.parametrize(("save", "signum", "code"), [("sigterm", signal.SIGTERM, 143),
                                                     ("never", signal.SIGTERM, 143), ("never", signal.SIGINT, 130)])
def test_sigterm_exits_143_without_a_traceback_and_says_how_to_resume(tmp_path, tiny_model_dir, save, signum, code):
    """SIGTERM once the loop runs: by default the step in progress ends with its checkpoint (save_steps is far
    away), no final model is written, and the resume command names the run's --set; Ctrl-C (130) says the same."""
    config = _config(tmp_path, tiny_model_dir, save_steps=1000 if save == "sigterm" else 1)
    process = subprocess.Popen([sys.executable, "-m", "coordexp", "train", str(config), "--set",
                                "training.max_steps=400", "--set", f"training.save_on_interrupt={save}"],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_sigint_as_in_a_terminal)
    run = tmp_path / "run"
    started = run / ("coordexp_config.yaml" if save == "sigterm" else "checkpoint-1")
    deadline = time.monotonic() + 300
    while not started.exists() and process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(4 if save == "sigterm" else 0)  # the loop is running
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    text = " ".join((stdout + stderr).split())
    assert process.returncode == code, text[-2000:]
    assert "Traceback" not in text and not (run / "model.safetensors").exists()
    assert "last complete checkpoint" in text
    assert "--resume auto --set training.max_steps=400 --set training.save_on_interrupt=" + save in text
    steps = sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))
    assert steps and steps[-1] < 400 and f"checkpoint-{steps[-1]}" in text


@pytest.mark.slow  # trains twice, with evaluation
def test_a_run_retrained_from_its_record_evaluates_and_warms_up_the_same_way(tmp_path, tiny_model_dir):
    import torch

    config = _init_stage1(tmp_path, tiny_model_dir)
    sets = ["--set", "training.max_steps=2", "--set", "training.eval_steps=1", "--set", "training.save_steps=2",
            "--set", "rollout_matching.max_new_tokens=32"]
    first = _run("train", str(config), *sets, "--set", f"training.output_dir={tmp_path / 'a'}")
    assert first.exit_code == 0, first.output
    again = _run("train", str(tmp_path / "a" / "coordexp_config.yaml"), "--set",
                 f"training.output_dir={tmp_path / 'b'}")
    assert again.exit_code == 0, again.output

    def figures(folder: Path) -> tuple:
        args = torch.load(folder / "training_args.bin", weights_only=False)
        state = json.loads((folder / "trainer_state.json").read_text())
        evaluations = sum(1 for entry in state["log_history"] if any(k.startswith("eval") for k in entry))
        return str(args.eval_strategy), args.warmup_steps, args.eval_steps, evaluations

    assert figures(tmp_path / "a") == figures(tmp_path / "b")
    assert figures(tmp_path / "a")[3] > 0


def test_resume_refuses_a_config_edited_since_the_record_unless_the_key_is_passed_again(tmp_path, tiny_model_dir):
    from coordexp.cli.overrides import apply_overrides, write_run_record
    from coordexp.schema.loader import load_merged

    config = _config(tmp_path, tiny_model_dir, save_steps=1)
    run = tmp_path / "run"
    write_run_record(run, apply_overrides(load_merged(config), ["training.max_steps=3"]), source=config,
                     overrides=["training.max_steps=3"])
    shutil.copytree(tiny_model_dir, run / "checkpoint-3")
    (run / "checkpoint-3" / "trainer_state.json").write_text('{"global_step": 3}')
    data = yaml.safe_load(config.read_text())
    data["data"]["max_train_samples"] = 3
    config.write_text(yaml.safe_dump(data))
    refused = _run("train", str(config), "--resume", "auto")
    assert refused.exit_code == 2, refused.output
    text = " ".join(refused.output.split())
    assert "change training: data.max_train_samples;" in text  # max_steps is the record's own (replayed)
    passed = _run("train", str(config), "--resume", "auto", "--set", "data.max_train_samples=3")
    assert passed.exit_code == 0, passed.output  # checkpoint-3 reached the recorded max_steps: nothing to train
    assert "already reached training.max_steps (3)" in " ".join(passed.output.split())
    assert (run / "config.json").is_file()  # the final model the run never saved, written from checkpoint-3


def test_show_rollouts_of_a_deep_rollout_log_exits_2(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rollouts.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    result = _run("show-rollouts", str(run))
    assert result.exit_code == 2, result.output


def _init_stage1(tmp_path: Path, model: Path) -> Path:
    """init's stage-1 recipe (evaluation, warmup) for the tiny model and a 4+2-image synthetic set."""
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    write_synthetic_dataset(tmp_path / "data", n_train=4, n_val=2, seed=0)
    config = tmp_path / "stage1.yaml"
    made = _run("init", "-o", str(config), "--model", str(model), "--device", "cpu",
                "--train-jsonl", str(tmp_path / "data" / "train.jsonl"),
                "--val-jsonl", str(tmp_path / "data" / "val.jsonl"))
    assert made.exit_code == 0, made.output
    return config
