"""Checkpoints are visible only when complete, ``--resume auto`` skips (and names) incomplete ones, and resuming a
run that already reached ``max_steps`` trains nothing (docs/design.md, decision 14)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.cli.train import resolve_resume
from coordexp.runtime.train import checkpoints
from coordexp.runtime.train.launch import build_trainer
from coordexp.runtime.train.run_log import read_run_log
from coordexp.runtime.train.trainer import CoordExpTrainer
from coordexp.schema.contract import load_contract

runner = CliRunner()


def _complete(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_resume_auto_takes_the_newest_complete_checkpoint_and_names_the_skipped(tmp_path):
    _complete(tmp_path / "checkpoint-2", 2)
    partial = tmp_path / "checkpoint-3"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")  # killed before trainer_state.json was written
    corrupt = _complete(tmp_path / "checkpoint-4", 4)
    (corrupt / "trainer_state.json").write_text("{not json")
    empty = _complete(tmp_path / "checkpoint-5", 5)
    (empty / "model.safetensors").write_bytes(b"")
    (tmp_path / "checkpoint-9").write_text("a file, not a checkpoint")
    choice = checkpoints.choose_resume(tmp_path)
    assert choice.path == tmp_path / "checkpoint-2"
    assert [(p.name, reason.split(" ")[0]) for p, reason in choice.skipped] == [
        ("checkpoint-5", "no"), ("checkpoint-4", "trainer_state.json"), ("checkpoint-3", "no")]
    assert resolve_resume("auto", str(tmp_path)) == str(tmp_path / "checkpoint-2")
    with pytest.raises(FileNotFoundError, match="no trainer_state.json"):
        resolve_resume(str(partial), str(tmp_path))


def test_resume_auto_with_only_incomplete_checkpoints_says_so(tmp_path):
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(FileNotFoundError, match=r"found no checkpoint to resume .* \(1 incomplete\)"):
        resolve_resume("auto", str(tmp_path))


def test_publish_renames_the_staged_checkpoint_into_place(tmp_path):
    staged = _complete(checkpoints.staging_dir(tmp_path, 7) / "checkpoint-7", 7)
    stale = _complete(tmp_path / "checkpoint-7", 3)  # an earlier attempt at the same step is replaced
    (stale / "old-only").write_text("x")
    final = checkpoints.publish_checkpoint(tmp_path, 7)
    assert final == tmp_path / "checkpoint-7" and not staged.exists()
    assert checkpoints.finished_step(final) == 7 and not (final / "old-only").exists()
    assert not checkpoints.staging_dir(tmp_path, 7).exists()
    leftover = checkpoints.staging_dir(tmp_path, 8)
    (leftover / "checkpoint-8").mkdir(parents=True)
    assert checkpoints.clear_staging(tmp_path) == [leftover] and not leftover.exists()
    assert final.is_dir()


def _stage1(write_config, tmp_path, **training):
    return write_config({
        "custom": {"trainer_variant": "stage1_sft"},
        "global_max_length": 1024,
        "training": {"output_dir": str(tmp_path / "run"), "per_device_train_batch_size": 2,
                     "gradient_accumulation_steps": 1, "logging_steps": 1, "packing": False, "learning_rate": 1e-3,
                     **training},
    })


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_an_interrupted_save_leaves_no_checkpoint_and_resume_auto_continues(tmp_path, write_config, monkeypatch):
    config = _stage1(write_config, tmp_path, max_steps=2, save_steps=1)
    trainer = build_trainer(load_contract(config))
    real = CoordExpTrainer._save_optimizer_and_scheduler

    def killed_at_step_2(self, output_dir):
        if self.state.global_step == 2:
            raise KeyboardInterrupt  # the process dies in the middle of writing checkpoint-2
        return real(self, output_dir)

    monkeypatch.setattr(CoordExpTrainer, "_save_optimizer_and_scheduler", killed_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    monkeypatch.undo()
    run = tmp_path / "run"
    assert (run / "checkpoint-1" / "trainer_state.json").is_file()
    assert not (run / "checkpoint-2").exists()  # only the staging directory holds the half-written save
    assert (checkpoints.staging_dir(run, 2) / "checkpoint-2" / "model.safetensors").is_file()

    result = runner.invoke(app, ["train", str(config), "--resume", "auto", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout[result.stdout.index("{"):])["global_step"] == 2
    starts = read_run_log(run, event="run_start")
    assert starts[-1]["resume_from"] == str(run / "checkpoint-1")
    assert not checkpoints.staging_dir(run, 2).exists()  # the leftover was cleared at start
    assert checkpoints.checkpoint_problem(run / "checkpoint-2") is None


@pytest.mark.slow
def test_resuming_a_finished_run_exits_0_without_training(tmp_path, write_config):
    config = _stage1(write_config, tmp_path, max_steps=2, save_steps=2)
    first = runner.invoke(app, ["train", str(config)], catch_exceptions=False)
    assert first.exit_code == 0, first.output
    run = tmp_path / "run"
    before = {str(p): _digest(p) for p in (run / "model.safetensors", run / "checkpoint-2" / "model.safetensors")}
    starts = len(read_run_log(run, event="run_start"))
    again = runner.invoke(app, ["train", str(config), "--resume", "auto"], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert "already reached training.max_steps (2)" in " ".join(again.output.split())
    after = {str(p): _digest(p) for p in (run / "model.safetensors", run / "checkpoint-2" / "model.safetensors")}
    assert after == before and len(read_run_log(run, event="run_start")) == starts  # nothing trained or written
    as_json = runner.invoke(app, ["train", str(config), "--resume", "auto", "--json"], catch_exceptions=False)
    assert as_json.exit_code == 0
    assert json.loads(as_json.stdout)["already_finished"] is True


@pytest.mark.slow
def test_best_model_tracking_points_at_published_checkpoints(tmp_path, write_config, dataset):
    """metric_for_best_model with evaluation every step: HF's tracking reads eval_<name> (once a KeyError at the first
    evaluation), and the best checkpoint it records is the published directory, never the staging one."""
    config = write_config({
        "custom": {"trainer_variant": "stage1_sft"}, "global_max_length": 1024,
        "data": {"val_jsonl": str(dataset.val_jsonl)},
        "rollout_matching": {"max_new_tokens": 16, "decode_batch_size": 2},
        "training": {"output_dir": str(tmp_path / "run"), "per_device_train_batch_size": 2, "packing": False,
                     "gradient_accumulation_steps": 1, "logging_steps": 1, "learning_rate": 1e-3, "max_steps": 3,
                     "save_steps": 1, "eval_steps": 1, "save_total_limit": 2, "metric_for_best_model": "match_rate"},
    }, name="best.yaml")
    trainer = build_trainer(load_contract(config))
    try:
        trainer.train()
    finally:
        trainer.backend.close()
    run = tmp_path / "run"
    best = Path(trainer.state.best_model_checkpoint)
    assert best.parent == run and best.is_dir() and checkpoints.checkpoint_problem(best) is None
    assert trainer.state.best_metric is not None and not list(run.glob(".staging-*"))
    saved = json.loads((run / f"checkpoint-{trainer.state.global_step}" / "trainer_state.json").read_text())
    assert saved["best_model_checkpoint"] == str(best)
    kept = sorted(p.name for p in run.glob("checkpoint-*"))
    assert best.name in kept and f"checkpoint-{trainer.state.global_step}" in kept and len(kept) <= 2
