"""Run hygiene of ``coordexp train`` / ``eval`` / ``serve-rollout`` (issue 38) and what ``train`` restores (issue 36
item 6): ``--set`` overrides validated like the file and recorded in the run folder, a used output folder refused
without ``--resume``/``--overwrite``, eval output per checkpoint; the launcher variables a zero2 check sets, the SIGINT
wakeup fd and its watcher thread restored (a handled Ctrl-C: tests/cli/test_interrupt_watch.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _stage1_config(root: Path, **training) -> Path:
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    build_tiny_model(root / "model", seed=0)
    write_synthetic_dataset(root / "data", n_train=4, n_val=2, seed=0)
    data = {
        "extends": str(EXAMPLES / "demo_stage2.yaml"),
        "global_max_length": 2048,
        "custom": {"trainer_variant": "stage1_sft"},
        "model": {"path": "./model"},
        "data": {"train_jsonl": "./data/train.jsonl", "val_jsonl": None},
        "training": {"output_dir": "./run", "max_steps": 1, "logging_steps": 1, "per_device_train_batch_size": 2,
                     "packing": False, **training},
    }
    path = root / "stage1.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.slow  # trains
def test_train_restores_environment_wakeup_fd_and_ends_its_watcher(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setattr(signal, "getsignal", lambda signum: signal.default_int_handler)  # as at a terminal
    config = _stage1_config(tmp_path, deepspeed="zero2")
    environment = dict(os.environ)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd)
    try:
        result = CliRunner().invoke(app, ["train", str(config)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert dict(os.environ) == environment  # RANK, WORLD_SIZE, MASTER_PORT, ACCELERATE_USE_DEEPSPEED gone
        assert not [t for t in threading.enumerate() if t.name == "interrupt-watch" and t.is_alive()]
        assert signal.set_wakeup_fd(previous) == write_fd  # the caller's wakeup fd is back
    finally:
        os.close(read_fd)
        os.close(write_fd)


# -- --set, used output folders, resume, eval / serve checkpoints ---------------------------------------------------


def _run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


@given(st.one_of(st.integers(-10**9, 10**9).map(str), st.sampled_from(
    ["2e-5", "010", "0o17", "0x1F", "on", "off", "yes", "no", "y", "n", "1:30", "~", "null", "true", "False", ".inf",
     "-.5", "1_000", "2001-12-14", "'quoted'", '"x"', "[1, 2]", "{a: 1}"]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_/.:-0123456789", min_size=1, max_size=12)))
def test_override_values_are_read_like_the_files(value):
    """--set reads a value exactly as the config files read it (YAML 1.2: 010 is 10, on is a string), not with
    PyYAML's YAML 1.1 safe_load (the old comparison could not fail)."""
    from coordexp.cli.overrides import parse_override
    from coordexp.schema.file_read import FileReadError
    from coordexp.schema.yaml_io import parse_yaml_text

    try:
        as_file = parse_yaml_text(f"c: {value}\n")["c"]
    except FileReadError:
        return  # not a value the files accept either (then --set refuses it: test_set_values_are_bounded...)
    override = parse_override(f"a.b.0.c={value}")
    assert override.path == ("a", "b", "0", "c")
    assert override.value == as_file and type(override.value) is type(as_file)


def test_overrides_reach_lists_by_index_and_refuse_bad_paths():
    from coordexp.cli.overrides import apply_overrides
    from coordexp.errors import UserInputError
    from coordexp.schema.loader import MergedConfig

    merged = MergedConfig({"a": {"items": [{"w": 1}, {"w": 2}], "n": 3}}, {("a",): "base.yaml"}, ("base.yaml",))
    changed = apply_overrides(merged, ["a.items.1.w=0.5", "a.new.key=x"])
    assert changed.data == {"a": {"items": [{"w": 1}, {"w": 0.5}], "n": 3, "new": {"key": "x"}}}
    assert merged.data["a"]["items"][1]["w"] == 2  # the loaded config is not changed in place
    assert changed.file_of(("a", "items", "1", "w")) == "--set" and changed.file_of(("a", "n")) == "base.yaml"
    for bad in ("a.items.5.w=1", "a.items.w=1", "a.n.deeper=1", "no_equals_sign", "a..b=1", "=1"):
        with pytest.raises(UserInputError):
            apply_overrides(merged, [bad])


@pytest.mark.slow  # trains
def test_set_overrides_record_the_run_and_a_used_folder_needs_resume_or_overwrite(tmp_path):
    config = _stage1_config(tmp_path, max_steps=3, save_steps=1)
    bad = _run("train", str(config), "--set", "training.max_stepz=1")
    assert bad.exit_code == 2 and "training.max_stepz" in bad.output  # validated like the file
    run = tmp_path / "run1"
    result = _run("train", str(config), "--set", "training.max_steps=1", "--set", f"training.output_dir={run}")
    assert result.exit_code == 0, result.output
    recorded = (run / "coordexp_config.yaml").read_text()
    assert '# --set: "training.max_steps=1"' in recorded and yaml.safe_load(recorded)["training"]["max_steps"] == 1
    assert (run / "checkpoint-1").is_dir()
    assert _run("validate", str(run / "coordexp_config.yaml")).exit_code == 0  # the record is a config that runs
    from coordexp.cli.frame import load_run_and_config

    original, _ = load_run_and_config(config, overrides=["training.max_steps=1", f"training.output_dir={run}"])
    from_record, _ = load_run_and_config(run / "coordexp_config.yaml")
    assert from_record.to_dict() == original.to_dict()  # the same resolved contract, not just a valid file
    again = _run("train", str(config), "--set", "training.max_steps=1", "--set", f"training.output_dir={run}")
    assert again.exit_code == 2 and "checkpoint-1" in again.output and "--overwrite" in again.output
    resumed = _run("train", str(config), "--set", "training.max_steps=2", "--set", f"training.output_dir={run}",
                   "--resume", "auto")
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming from {run / 'checkpoint-1'}" in " ".join(resumed.output.split())
    fresh = _run("train", str(config), "--set", "training.max_steps=1", "--set", f"training.output_dir={run}",
                 "--overwrite")
    assert fresh.exit_code == 0, fresh.output
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"]  # the old run's checkpoint-2 went


def test_used_output_problem_names_checkpoints_and_saved_models(tmp_path):
    from coordexp.runtime.train.run_folder import used_output_problem

    assert used_output_problem(tmp_path / "absent") is None and used_output_problem(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "saved model" in used_output_problem(tmp_path)
    (tmp_path / "checkpoint-7").mkdir()
    assert "checkpoint-7" in used_output_problem(tmp_path)


def test_eval_writes_per_checkpoint_and_prints_no_bare_percent(tmp_path):
    from types import SimpleNamespace

    from coordexp.cli.evaluate import _pct, default_out_dir

    run = SimpleNamespace(training=SimpleNamespace(output_dir=str(tmp_path / "out")))
    assert default_out_dir(run, None, "val") == tmp_path / "out" / "eval_val"
    assert default_out_dir(run, tmp_path / "out" / "checkpoint-20", "val") == tmp_path / "out" / "eval_checkpoint-20"
    assert default_out_dir(run, tmp_path / "out" / "checkpoint-20", "train") == (
        tmp_path / "out" / "eval_checkpoint-20_train")
    assert _pct(None) == "-" and _pct(0.5) == "50.0%"


def test_serve_rollout_checkpoint_without_a_saved_model_exits_2(tmp_path):
    config = _stage1_config(tmp_path)
    result = _run("serve-rollout", str(config), "--checkpoint", str(tmp_path / "data"), "--port", "0")
    assert result.exit_code == 2, result.output
    assert "--checkpoint" in result.output and "holds no saved model" in result.output


@pytest.mark.slow  # starts a process that trains
def test_a_plain_run_shows_its_evaluation_without_wrapped_lines_or_deepspeed_chatter(tmp_path):
    """What a user piping ``coordexp train`` sees: eval figures on stdout, no bare-number line (a wrapped tok/s),
    no DeepSpeed "Setting accelerator to CPU" line from a run that does not use DeepSpeed."""
    config = _stage1_config(tmp_path, max_steps=2, eval_steps=1)
    data = yaml.safe_load(config.read_text())
    data["data"]["val_jsonl"] = "./data/val.jsonl"
    config.write_text(yaml.safe_dump(data))
    done = subprocess.run([sys.executable, "-m", "coordexp", "train", str(config)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "80", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert any(line.startswith("eval  step 1  AP50 ") for line in done.stdout.splitlines()), done.stdout
    assert not [line for line in lines if line.strip().replace(".", "").isdigit()]
    assert "real_accelerator" not in done.stdout + done.stderr
    assert "eval at step 2: AP50" in " ".join(done.stdout.split())


@pytest.mark.slow  # trains
def test_report_to_tensorboard_writes_events_under_the_run_and_plot_run_draws_its_curves(tmp_path):
    pytest.importorskip("tensorboard")
    config = _stage1_config(tmp_path, max_steps=2, eval_steps=1, report_to=["tensorboard"])
    data = yaml.safe_load(config.read_text())
    data["data"]["val_jsonl"] = "./data/val.jsonl"
    config.write_text(yaml.safe_dump(data))
    before = os.environ.get("TENSORBOARD_LOGGING_DIR")
    result = _run("train", str(config))
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    assert list(run.rglob("events.out.tfevents.*")), sorted(str(p) for p in run.rglob("*"))
    assert os.environ.get("TENSORBOARD_LOGGING_DIR") == before
    plotted = _run("plot-run", str(run))
    assert plotted.exit_code == 0, plotted.output
    from PIL import Image

    with Image.open(run / "curves.png") as image:
        assert image.size[0] == 900 and len(image.getcolors(1 << 16) or []) > 3  # axes, a loss and eval curves
    missing = _run("plot-run", str(tmp_path / "data"))
    assert missing.exit_code == 2 and "trainer_state.json" in missing.output
