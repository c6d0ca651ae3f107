"""Round seven's run-folder findings (issue 56): a run always ends with the model it trained, eval never measures
the starting model in its place, and no output is written through a link onto a file the run did not create.
Each test names its finding; each failed on the code before the fix."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app
from tests.cli.test_run_folder_trust import _config as _stage1_config


def _run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def _text(result) -> str:
    return " ".join(result.output.split())


def _config(root: Path, model: Path, *, val: bool = True, **training) -> Path:
    """test_run_folder_trust's stage-1 config, two steps, with the synthetic validation split where ``val``."""
    path = _stage1_config(root, model, **{"max_steps": 2, **training})
    if val:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        data["data"]["val_jsonl"] = "./data/val.jsonl"
        path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _unfinished_run(tmp_path: Path, model: Path, *, step: int = 2) -> tuple[Path, Path]:
    """A run folder as SIGTERM in the last step left it: the record and ``checkpoint-<step>``, no final model."""
    from coordexp.cli.overrides import apply_overrides, write_run_record
    from coordexp.schema.loader import load_merged

    config = _config(tmp_path, model)
    run = tmp_path / "run"
    write_run_record(run, apply_overrides(load_merged(config), []), source=config, overrides=[])
    shutil.copytree(model, run / f"checkpoint-{step}")
    (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return config, run


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- item 1: SIGTERM in the last step, then eval ----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["eval", "probe"])
def test_eval_of_a_run_without_its_final_model_exits_2_naming_the_checkpoint(tmp_path, tiny_model_dir, command):
    config, run = _unfinished_run(tmp_path, tiny_model_dir)
    result = _run(command, str(config), "--limit", "1")
    assert result.exit_code == 2, result.output
    text = _text(result)
    assert "without its final model" in text and str(run / "checkpoint-2") in text
    assert not any(name.startswith(("eval_", "probe_")) for name in os.listdir(run))


def test_resume_auto_of_a_finished_checkpoint_writes_the_final_model_and_eval_then_finds_it(tmp_path,
                                                                                               tiny_model_dir):
    from coordexp.cli.evaluate import resolve_checkpoint
    from coordexp.cli.frame import load_run

    config, run = _unfinished_run(tmp_path, tiny_model_dir)
    result = _run("train", str(config), "--resume", "auto", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout[result.stdout.index("{"):])
    assert payload["already_finished"] and payload["final_model_written"]
    assert _sha(run / "model.safetensors") == _sha(run / "checkpoint-2" / "model.safetensors")
    assert not (run / "optimizer.pt").exists()
    assert resolve_checkpoint(load_run(config), None) == run
    again = _run("train", str(config), "--resume", "auto", "--json")  # the second time there is nothing to write
    assert json.loads(again.stdout[again.stdout.index("{"):])["final_model_written"] is False


@pytest.mark.parametrize("own_readme", [False, True])
def test_finishing_from_a_checkpoint_writes_a_card_and_never_copies_the_checkpoints_readme(tmp_path, tiny_model_dir,
                                                                                           own_readme):
    """The model card also for a run finished from its checkpoint; the checkpoint's README.md (PEFT's template in
    a LoRA checkpoint) is no model file: copying it replaced the user's README.md in the run folder."""
    config, run = _unfinished_run(tmp_path, tiny_model_dir)
    (run / "checkpoint-2" / "README.md").write_text("---\nlibrary_name: peft\n---\n# Model Card for Model ID\n")
    if own_readme:
        (run / "README.md").write_text("my notes on this run\n")
    result = _run("train", str(config), "--resume", "auto")
    assert result.exit_code == 0, result.output
    card = (run / "README.md").read_text(encoding="utf-8")
    if own_readme:
        assert card == "my notes on this run\n" and "left as it is" in _text(result)
    else:
        assert "Model Card for Model ID" not in card and str(config) in card and "2" in card


def test_a_finished_checkpoint_with_broken_weights_is_not_made_the_final_model(tmp_path, tiny_model_dir):
    config, run = _unfinished_run(tmp_path, tiny_model_dir)
    (run / "checkpoint-2" / "model.safetensors").write_bytes(b"x" * 10)
    result = _run("train", str(config), "--resume", "auto")
    assert result.exit_code == 2, result.output
    assert "model.safetensors" in _text(result) and not (run / "config.json").exists()
    from coordexp.cli.train import _finish_from  # the finishing step's own check, behind the resume check
    with pytest.raises(typer.Exit):
        _finish_from(str(run / "checkpoint-2"), str(run))
    assert not (run / "config.json").exists()


@pytest.mark.slow  # trains two steps, twice
@pytest.mark.parametrize("when", ["last_step", "final_save"])
def test_sigterm_in_the_last_step_or_the_final_save_still_writes_the_final_model(tmp_path, tiny_model_dir, when):
    from transformers import TrainerCallback

    from coordexp.cli.frame import load_run
    from coordexp.cli.signals import terminate_as_interrupt
    from coordexp.runtime.train.launch import StopRequest, run_training

    class SigtermAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if when == "last_step" and state.global_step == state.max_steps:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_train_end(self, args, state, control, **kwargs):
            if when == "final_save":  # after the loop, before the final save
                os.kill(os.getpid(), signal.SIGTERM)

    config = _config(tmp_path, tiny_model_dir, val=False, save_steps=1000)
    run = load_run(config)
    stop = StopRequest()
    with terminate_as_interrupt(stop):
        outcome = run_training(run, callbacks=[SigtermAt()], print_logs=False, stop=stop)
    assert stop.asked and outcome.global_step == 2
    folder = Path(run.training.output_dir)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert (folder / "trainer_state.json").is_file()


# -- item 16: the run record is never written through a link ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["link_to_config", "link_to_notes", "fifo", "folder"])
def test_resume_refuses_a_record_place_that_is_no_record_before_anything_loads(tmp_path, tiny_model_dir, kind):
    config = _config(tmp_path, tiny_model_dir)
    run = tmp_path / "run"
    run.mkdir()
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    record = run / "coordexp_config.yaml"
    if kind == "link_to_config":
        os.symlink(config, record)
    elif kind == "link_to_notes":
        os.symlink(notes, record)
    elif kind == "fifo":
        os.mkfifo(record)
    else:
        record.mkdir()
    before = {p: _sha(p) for p in (config, notes)}
    result = _run("train", str(config), "--resume", "auto")
    assert result.exit_code == 2, result.output
    assert "coordexp_config.yaml" in _text(result) and "nothing was loaded or written" in _text(result)
    assert {p: _sha(p) for p in (config, notes)} == before


def test_the_record_append_replaces_a_link_put_there_instead_of_writing_through_it(tmp_path, tiny_model_dir):
    from coordexp.cli.overrides import append_resume_record
    from coordexp.errors import UserInputError

    _, run = _unfinished_run(tmp_path, tiny_model_dir)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    (run / "coordexp_config.yaml").unlink()
    os.symlink(notes, run / "coordexp_config.yaml")
    with pytest.raises(UserInputError):
        append_resume_record(run, checkpoint=str(run / "checkpoint-2"), overrides=[])
    assert notes.read_text() == "my notes\n"


# -- items 4 and 17: probe checks its own file names and never writes through a link ---------------------------------


@pytest.mark.parametrize("name", ["probe.json", "recall_by_rank.png"])
@pytest.mark.parametrize("kind", ["link_to_train_data", "fifo", "folder"])
def test_probe_out_holding_a_link_fifo_or_folder_at_its_result_names_exits_2_first(tmp_path, tiny_model_dir, name,
                                                                                  kind):
    config = _config(tmp_path, tiny_model_dir)
    out = tmp_path / "probe_out"
    out.mkdir()
    train = tmp_path / "data" / "train.jsonl"
    before = _sha(train)
    if kind == "link_to_train_data":
        os.symlink(train, out / name)
    elif kind == "fifo":
        os.mkfifo(out / name)
    else:
        (out / name).mkdir()
    result = _run("probe", str(config), "--out", str(out), "--limit", "1", "--oracle-k", "0")
    assert result.exit_code == 2, result.output
    assert name in _text(result) and _sha(train) == before


def test_results_are_renamed_into_place_so_a_link_or_fifo_there_is_replaced_not_followed(tmp_path):
    from coordexp.runtime.train.run_folder import write_result_file

    victim = tmp_path / "trainer_state.json"
    victim.write_text('{"keep": true}')
    os.symlink(victim, tmp_path / "probe.json")
    os.mkfifo(tmp_path / "metrics.json")
    write_result_file(tmp_path / "probe.json", b"{}\n")
    write_result_file(tmp_path / "metrics.json", b"{}\n")  # a FIFO would block an open(); a rename replaces it
    assert victim.read_text() == '{"keep": true}'
    for name in ("probe.json", "metrics.json"):
        path = tmp_path / name
        assert not path.is_symlink() and path.is_file() and path.read_bytes() == b"{}\n"
    assert sorted(os.listdir(tmp_path)) == ["metrics.json", "probe.json", "trainer_state.json"]


# -- items 8, 20, 22, 24: the run folder's layout in one place ---------------------------------------------------------


def test_overwrite_moves_probe_results_and_per_rank_logs_with_the_run(tmp_path):
    from coordexp.runtime.train.run_folder import move_previous_run

    run = tmp_path / "run"
    for folder in ("checkpoint-1", "probe_val", "eval_val"):
        (run / folder).mkdir(parents=True)
    for name in ("run_metadata.jsonl", "run_metadata.rank1.jsonl", "notes.txt"):
        (run / name).write_text("x")
    target, moved = move_previous_run(run)
    assert sorted(moved) == ["checkpoint-1", "eval_val", "probe_val", "run_metadata.jsonl",
                             "run_metadata.rank1.jsonl"]
    assert sorted(os.listdir(run)) == [".previous", "notes.txt"]


def test_resume_auto_never_follows_a_checkpoint_link_into_another_run(tmp_path, tiny_model_dir):
    from coordexp.runtime.train.checkpoints import choose_resume

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other / "checkpoint-4")
    (other / "checkpoint-4" / "trainer_state.json").write_text('{"global_step": 4}')
    run = tmp_path / "run"
    shutil.copytree(other / "checkpoint-4", run / "checkpoint-2")
    (run / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    os.symlink(other / "checkpoint-4", run / "checkpoint-8")
    choice = choose_resume(run)
    assert choice.path == run / "checkpoint-2"
    assert [(path.name, str(other / "checkpoint-4") in why) for path, why in choice.skipped] == [
        ("checkpoint-8", True)]


@pytest.mark.parametrize("kind", ["file", "dangling_link", "loop", "fifo", "link_to_folder"])
def test_overwrite_refuses_a_previous_entry_that_is_no_folder_before_the_build(tmp_path, tiny_model_dir, kind):
    config, run = _unfinished_run(tmp_path, tiny_model_dir)
    previous = run / ".previous"
    if kind == "file":
        previous.write_text("x")
    elif kind == "dangling_link":
        os.symlink(tmp_path / "nowhere", previous)
    elif kind == "loop":
        os.symlink(previous, previous)
    elif kind == "fifo":
        os.mkfifo(previous)
    else:
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", previous)
    listing = sorted(os.listdir(run))
    result = _run("train", str(config), "--overwrite")
    assert result.exit_code == 2, result.output
    assert ".previous" in _text(result) and "nothing was loaded or written" in _text(result)
    assert sorted(os.listdir(run)) == listing


def test_eval_and_probe_results_of_the_starting_model_do_not_make_the_folder_foreign(tmp_path):
    from coordexp.runtime.train.run_folder import foreign_entries

    run = tmp_path / "run"
    (run / "eval_val" / "png").mkdir(parents=True)
    for name in ("metrics.json", "predictions.jsonl", "coco_gt.json", "coco_results.json"):
        (run / "eval_val" / name).write_text("{}")
    (run / "eval_val" / "png" / "eval_0000.png").write_bytes(b"png")
    (run / "probe_val").mkdir()
    (run / "probe_val" / "probe.json").write_text("{}")
    assert foreign_entries(run) == []
    (run / "probe_val" / "my_notes.txt").write_text("mine")  # a folder holding a user's file stays foreign
    (run / "eval_mine").symlink_to(tmp_path)
    assert foreign_entries(run) == ["eval_mine", "probe_val"]


# -- items 2 and 3: a --set on --resume is applied or refused, and a recorded path means the same file -------------


def test_resume_refuses_a_new_learning_rate_the_checkpoints_optimizer_would_override(tmp_path, tiny_model_dir):
    config, run = _unfinished_run(tmp_path, tiny_model_dir, step=1)
    record = (run / "coordexp_config.yaml").read_text()
    result = _run("train", str(config), "--resume", "auto", "--set", "training.learning_rate=5e-4")
    assert result.exit_code == 2, result.output
    text = _text(result)
    assert "cannot change training.learning_rate" in text and "restored from the checkpoint" in text
    assert (run / "coordexp_config.yaml").read_text() == record  # the record claims nothing it did not use


@pytest.mark.slow  # trains three steps, then one more
def test_resume_applies_a_new_save_steps_and_says_when_the_schedule_is_restretched(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir, val=False, save_steps=1, max_steps=3, lr_scheduler_type="cosine")
    assert _run("train", str(config)).exit_code == 0
    run = tmp_path / "run"
    for name in ("checkpoint-2", "checkpoint-3"):
        shutil.rmtree(run / name)
    for path in run.iterdir():
        if path.is_file() and path.name != "coordexp_config.yaml":
            path.unlink()
    result = _run("train", str(config), "--resume", "auto", "--set", "training.save_steps=2", "--set",
                  "training.max_steps=4")
    assert result.exit_code == 0, result.output
    assert (run / "checkpoint-2").is_dir() and (run / "checkpoint-4").is_dir()
    assert not (run / "checkpoint-3").exists()  # the checkpoint's save_steps (1) no longer rules
    assert "re-stretched over 4 steps" in _text(result)


def test_a_relative_set_path_is_recorded_resolved_and_replayed_as_the_same_file(tmp_path, tiny_model_dir,
                                                                                monkeypatch):
    from coordexp.cli.overrides import apply_overrides, recorded_overrides, write_run_record
    from coordexp.schema.loader import load_merged

    config = _config(tmp_path, tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    given = ["data.train_jsonl=data/train.jsonl"]
    write_run_record(tmp_path / "run", apply_overrides(load_merged(config), given), source=config, overrides=given)
    assert recorded_overrides(tmp_path / "run") == [
        f"data.train_jsonl={json.dumps(str(tmp_path / 'data' / 'train.jsonl'))}"]


def test_resume_from_another_folder_refuses_a_recorded_relative_path_that_now_names_another_file(
        tmp_path, tiny_model_dir, monkeypatch):
    """A record written before paths were resolved holds ``data/train.jsonl`` as given: replayed from folder B it
    would name B's file; the drift check no longer exempts a recorded key, so it is refused."""
    config, run = _unfinished_run(tmp_path, tiny_model_dir, step=1)
    record = run / "coordexp_config.yaml"
    lines = record.read_text().splitlines()
    lines.insert(2, '# --set: "data.train_jsonl=data/train.jsonl"')
    record.write_text("\n".join(lines) + "\n")
    elsewhere = tmp_path / "B"
    shutil.copytree(tmp_path / "data", elsewhere / "data")
    monkeypatch.chdir(elsewhere)
    result = _run("train", str(config), "--resume", "auto")
    assert result.exit_code == 2, result.output
    assert "data.train_jsonl" in _text(result)


# -- item 19: every loader refuses NaN or Inf weights ----------------------------------------------------------------


@pytest.mark.parametrize("command", ["eval", "probe"])
@pytest.mark.parametrize("bad", ["all_nan", "one_inf"])
def test_eval_and_probe_of_non_finite_weights_exit_2_writing_nothing(tmp_path, tiny_model_dir, command, bad):
    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, model)
    weights = load_file(str(model / "model.safetensors"))
    name = next(k for k, v in weights.items() if v.is_floating_point())
    if bad == "all_nan":
        weights = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in weights.items()}
    else:
        weights[name] = weights[name].clone()
        weights[name].view(-1)[0] = float("inf")
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    config = _config(tmp_path, tiny_model_dir)
    out = tmp_path / "results"
    result = _run(command, str(config), "--checkpoint", str(model), "--out", str(out), "--limit", "1")
    assert result.exit_code == 2, result.output
    assert "non-finite" in _text(result)
    assert not out.exists() or not any(out.rglob("*.json"))


# -- item 10: a NaN loss stops the run before its backward, whatever is logged ----------------------------------------


@pytest.mark.slow  # trains a step
def test_a_nan_loss_stops_before_its_backward_and_no_checkpoint_of_it_is_written(tmp_path, tiny_model_dir,
                                                                                monkeypatch):
    import dataclasses

    from coordexp.cli.frame import load_run
    from coordexp.runtime.train.launch import NonFiniteTrainingError, run_training
    from coordexp.runtime.train.trainer import CoordExpTrainer

    real = CoordExpTrainer._objective

    def nan_from_the_second_step(self, *args, **kwargs):
        logits, result = real(self, *args, **kwargs)
        if self.state.global_step >= 1:
            result = dataclasses.replace(result, total=result.total * float("nan"))
        return logits, result

    monkeypatch.setattr(CoordExpTrainer, "_objective", nan_from_the_second_step)
    config = _config(tmp_path, tiny_model_dir, val=False, save_steps=1, logging_steps=1000)  # nothing logged
    with pytest.raises(NonFiniteTrainingError, match="at step 2, before its backward"):
        run_training(load_run(config), print_logs=False)
    run = tmp_path / "run"
    assert (run / "checkpoint-1").is_dir() and not (run / "checkpoint-2").exists()
    assert not (run / "model.safetensors").exists()


# -- item 13: eval and probe refuse a missing optional package before any weight loads ---------------------------------


@pytest.mark.parametrize("command", ["eval", "probe"])
def test_eval_and_probe_name_a_missing_optional_package_before_loading_the_model(tmp_path, tiny_model_dir,
                                                                                   command, monkeypatch):
    import coordexp.runtime.model.policy as policy

    config = _config(tmp_path, tiny_model_dir)
    data = yaml.safe_load(config.read_text())
    data["model"]["attn_implementation"] = "flash_attention_2"
    config.write_text(yaml.safe_dump(data))
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    result = _run(command, str(config), "--limit", "1")
    assert result.exit_code == 3, result.output
    assert "flash-attn" in _text(result)


# -- item 21: a checkpoint HF could not resume from is refused before the model loads ---------------------------------


class _Code:
    """Pickled as a class reference: ``weights_only`` loading refuses it (code, not data)."""


@pytest.mark.parametrize("case", ["state_not_a_trainer_state", "state_log_history_not_a_list", "truncated_weights",
                                  "garbage_weights", "rng_state_with_code", "rng_state_truncated",
                                  "lora_checkpoint_into_a_full_run"])
def test_resume_refuses_a_checkpoint_hf_could_not_resume_from_before_the_model_loads(tmp_path, tiny_model_dir,
                                                                                      case, monkeypatch):
    import torch

    import coordexp.runtime.model.policy as policy

    config, run = _unfinished_run(tmp_path, tiny_model_dir, step=1)
    checkpoint = run / "checkpoint-1"
    weights = checkpoint / "model.safetensors"
    named = {"state_not_a_trainer_state": "trainer_state.json", "state_log_history_not_a_list": "trainer_state.json",
             "truncated_weights": "model.safetensors", "garbage_weights": "model.safetensors",
             "rng_state_with_code": "rng_state.pth", "rng_state_truncated": "rng_state.pth",
             "lora_checkpoint_into_a_full_run": "LoRA adapter"}[case]
    if case == "state_not_a_trainer_state":
        (checkpoint / "trainer_state.json").write_text('{"global_step": 1, "no_such_field": 2}')
    elif case == "state_log_history_not_a_list":
        (checkpoint / "trainer_state.json").write_text('{"global_step": 1, "log_history": 7}')
    elif case == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif case == "garbage_weights":
        weights.write_bytes(b"\x00garbage" * 64)
    elif case == "rng_state_with_code":
        torch.save({"python": _Code()}, checkpoint / "rng_state.pth")
    elif case == "rng_state_truncated":
        torch.save({"cpu": torch.zeros(1000)}, checkpoint / "rng_state.pth")
        (checkpoint / "rng_state.pth").write_bytes((checkpoint / "rng_state.pth").read_bytes()[:300])
    else:
        (checkpoint / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        weights.rename(checkpoint / "adapter_model.safetensors")  # a LoRA run's checkpoint: no config.json
        (checkpoint / "config.json").unlink()
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    result = _run("train", str(config), "--resume", "auto")
    assert result.exit_code == 2, result.output
    assert named in _text(result) and "Traceback" not in result.output


# -- item 26: an adapter whose recorded base is gone is not silently put on model.path --------------------------------


def test_an_adapter_whose_recorded_base_is_gone_says_which_base_it_uses_instead(tmp_path, tiny_model_dir, caplog):
    from coordexp.runtime.model.adapters import adapter_base

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
        "base_model_name_or_path": str(tmp_path / "moved-away-base")}))
    with caplog.at_level("WARNING", logger="coordexp.adapters"):
        assert adapter_base(adapter, str(tiny_model_dir)) == str(tiny_model_dir)
    text = " ".join(caplog.text.split())
    assert "moved-away-base" in text and "not a local checkpoint" in text and str(tiny_model_dir) in text
    caplog.clear()
    (adapter / "adapter_config.json").write_text(json.dumps({  # a hub id as the base: model.path is its local copy
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
        "base_model_name_or_path": "Qwen/Qwen2.5-VL-3B-Instruct"}))
    with caplog.at_level("WARNING", logger="coordexp.adapters"):
        assert adapter_base(adapter, str(tiny_model_dir)) == str(tiny_model_dir)
    assert caplog.text == ""


# -- item 25: a dangling link as output_dir or logging_dir, a --checkpoint name too long -------------------------------


@pytest.mark.parametrize("key", ["output_dir", "logging_dir"])
def test_a_dangling_link_as_the_run_folder_or_log_folder_is_exit_2(tmp_path, tiny_model_dir, key):
    config = _config(tmp_path, tiny_model_dir)
    link = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere" / "deeper", link)
    result = _run("train", str(config), "--set", f"training.{key}={link}")
    assert result.exit_code == 2, result.output
    assert "does not exist" in _text(result)


def test_an_eval_checkpoint_name_too_long_for_the_file_system_is_exit_2(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir)
    result = _run("eval", str(config), "--checkpoint", str(tmp_path / ("x" * 300)))
    assert result.exit_code == 2, result.output
    assert "--checkpoint" in _text(result)


# -- item 28: every missing optional package is named, with its extra, and exits 3 the same way ------------------------


def test_three_missing_packages_are_all_named_with_their_extras_and_train_exits_3_before_loading(
        tmp_path, tiny_model_dir, monkeypatch):
    import coordexp.runtime.model.policy as policy

    config = _config(tmp_path, tiny_model_dir)
    data = yaml.safe_load(config.read_text())
    data["training"].update({"report_to": ["tensorboard"], "deepspeed": "zero2"})
    data["tuner"] = {"train_type": "lora", "lora_rank": 4, "lora_alpha": 8}
    config.write_text(yaml.safe_dump(data))
    for module in ("tensorboard", "tensorboardX", "deepspeed", "peft"):
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    checked = _run("validate", str(config))
    assert checked.exit_code == 0, checked.output
    text = _text(checked)
    for line in ("pip install 'coordexp[tensorboard]'", "pip install 'coordexp[deepspeed]'", "pip install 'peft"):
        assert line in text, text
    trained = _run("train", str(config))
    assert trained.exit_code == 3, trained.output
    text = _text(trained)
    assert all(name in text for name in ("tensorboard", "deepspeed", "peft"))


def test_the_resume_message_says_which_set_wins(tmp_path, tiny_model_dir):
    """Issue 55, item 7: the resume message named the recorded --sets but not which of two values wins."""
    from coordexp.cli.overrides import apply_overrides, write_run_record
    from coordexp.schema.loader import load_merged

    config, run = _unfinished_run(tmp_path, tiny_model_dir, step=2)
    given = ["training.save_steps=7"]
    write_run_record(run, apply_overrides(load_merged(config), given), source=config, overrides=given)
    result = _run("train", str(config), "--resume", "auto", "--set", "training.save_steps=9")
    assert result.exit_code == 0, result.output
    text = _text(result)
    assert "--set training.save_steps=7" in text and "these win over the recorded ones: --set training.save_steps=9" in text


@pytest.mark.slow  # rolls out the random tiny model
def test_an_eval_where_nothing_parses_says_why_and_what_to_do(tmp_path, tiny_model_dir):
    """Issue 55, item 7: the random stand-in model writes no JSON; eval printed 0% with no hint."""
    config = _config(tmp_path, tiny_model_dir)
    data = yaml.safe_load(config.read_text())
    data.setdefault("rollout_matching", {})["max_new_tokens"] = 16
    config.write_text(yaml.safe_dump(data))
    result = _run("eval", str(config), "--limit", "1", "--pngs", "0")
    assert result.exit_code == 0, result.output
    assert "nothing the model wrote parsed as an object" in _text(result) and "stage-1 checkpoint" in _text(result)
