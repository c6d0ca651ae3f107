"""The DeepSpeed checks that need the launch (issue 45): a ``train_batch_size`` that does not match WORLD_SIZE and an
``amp`` block are exit 2 before the model loads (they passed ``validate`` and failed after the model loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

def _run(tmp_path: Path, tiny_model_dir: Path, ds: dict):
    """init's stage-1 config for the tiny model, with ``ds`` as its DeepSpeed file."""
    from typer.testing import CliRunner

    from coordexp.cli.app import app
    from coordexp.cli.frame import load_run_and_config

    (tmp_path / "ds.json").write_text(json.dumps(ds))
    (tmp_path / "train.jsonl").write_text("{}\n")
    config = tmp_path / "cfg.yaml"
    if not config.exists():
        made = CliRunner().invoke(app, ["init", "-o", str(config), "--model", str(tiny_model_dir), "--device", "cpu",
                                        "--train-jsonl", str(tmp_path / "train.jsonl")])
        assert made.exit_code == 0, made.output
    run, _ = load_run_and_config(config, overrides=[f"training.deepspeed={tmp_path / 'ds.json'}",
                                                    "training.per_device_train_batch_size=2",
                                                    "training.gradient_accumulation_steps=1",
                                                    "training.effective_batch_size=null"])
    return run


BASE = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2}}


@pytest.mark.parametrize(("extra", "word"), [({"train_batch_size": 8}, "train_batch_size"),
                                             ({"amp": {"enabled": False}}, "amp")])
def test_deepspeed_values_refused_at_this_launch(tmp_path, tiny_model_dir, monkeypatch, extra, word):
    from coordexp.runtime.train.args_check import deepspeed_issues

    monkeypatch.setenv("WORLD_SIZE", "2")
    issues = deepspeed_issues(_run(tmp_path, tiny_model_dir, {**BASE, **extra}))
    assert issues and all(i.path == "training.deepspeed" for i in issues) and word in issues[0].message


def test_a_matching_or_auto_batch_passes(tmp_path, tiny_model_dir, monkeypatch):
    from coordexp.runtime.train.args_check import deepspeed_issues

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert deepspeed_issues(_run(tmp_path, tiny_model_dir, {**BASE, "train_batch_size": 4})) == []
    assert deepspeed_issues(_run(tmp_path, tiny_model_dir, {**BASE, "train_batch_size": "auto"})) == []
