"""``--resume`` reads a checkpoint's ``trainer_state.json`` through the bounded reader (issue 45): a 100k-deep
document, a 401-digit step or a FIFO is a named problem (the checkpoint is skipped, exit 2), never exit 1 or a hang."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from coordexp.runtime.train.checkpoints import checkpoint_problem, choose_resume


@pytest.mark.parametrize("state", ["[" * 100_000 + "]" * 100_000, '{"global_step": 1' + "0" * 400 + "}",
                                   '{"global_step": "2"}', "not json", "fifo"])
def test_a_damaged_trainer_state_is_a_named_problem(tmp_path, state):
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"x")
    if state == "fifo":
        os.mkfifo(checkpoint / "trainer_state.json")
    else:
        (checkpoint / "trainer_state.json").write_text(state)
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and "trainer_state.json" in problem
    choice = choose_resume(tmp_path)
    assert choice.path is None and choice.skipped[0][0] == checkpoint


def test_a_sound_checkpoint_is_chosen(tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"x")
    (checkpoint / "trainer_state.json").write_text('{"global_step": 2}')
    assert checkpoint_problem(checkpoint) is None and choose_resume(tmp_path).path == checkpoint


class _Code:
    """Pickled as a class reference: ``weights_only`` loading refuses it (code, not tensors)."""


@pytest.mark.parametrize("content", ["pickled_code", "truncated", "fifo"])
def test_a_broken_or_foreign_optimizer_state_is_exit_2_naming_the_file(tmp_path, content, tiny_model_dir):
    import torch
    from typer.testing import CliRunner

    from coordexp.cli.app import app
    from coordexp.cli.overrides import write_run_record
    from coordexp.runtime.train.checkpoints import resume_files_problem
    from coordexp.schema.loader import load_merged

    checkpoint = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(tiny_model_dir, checkpoint)
    (checkpoint / "trainer_state.json").write_text('{"global_step": 1}')
    torch.save({"state": {}, "param_groups": []}, checkpoint / "scheduler.pt")
    optimizer = checkpoint / "optimizer.pt"
    torch.save({"state": {}, "param_groups": []}, optimizer)
    assert resume_files_problem(checkpoint) is None  # intact
    optimizer.unlink()
    if content == "pickled_code":
        torch.save({"state": _Code()}, optimizer)
    elif content == "truncated":
        torch.save({"state": {0: torch.zeros(100)}}, optimizer)
        optimizer.write_bytes(optimizer.read_bytes()[:200])
    else:
        os.mkfifo(optimizer)
    problem = resume_files_problem(checkpoint)
    assert problem is not None and "optimizer.pt" in problem

    data = {"extends": str(Path(__file__).resolve().parents[2] / "examples" / "demo_stage2.yaml"),
            "global_max_length": 2048, "custom": {"trainer_variant": "stage1_sft"},
            "model": {"path": str(tiny_model_dir)}, "data": {"train_jsonl": str(tmp_path / "t.jsonl")},
            "training": {"output_dir": str(tmp_path / "run"), "max_steps": 3}}
    (tmp_path / "t.jsonl").write_text("{}\n")
    config = tmp_path / "cfg.yaml"
    config.write_text(json.dumps(data))
    write_run_record(tmp_path / "run", load_merged(config), source=config, overrides=[])
    result = CliRunner().invoke(app, ["train", str(config), "--resume", "auto"], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "optimizer.pt" in result.output
