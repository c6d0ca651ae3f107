"""``coordexp train`` / ``show-rollouts`` and the progress callback: exit codes, outputs, the numbers displayed."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("train")
    build_tiny_model(root / "model", seed=0)
    write_synthetic_dataset(root / "data", n_train=8, n_val=2, seed=0)
    return root


def _config(root: Path, name: str, **training) -> Path:
    """A tiny stage-2 config extending the demo's, with paths into ``root`` (relative to the written file)."""
    data = {
        "extends": str(EXAMPLES / "demo_stage2.yaml"),
        "global_max_length": 2048,
        "model": {"path": "./model"},
        "data": {"train_jsonl": "./data/train.jsonl", "val_jsonl": None},
        "training": {"output_dir": f"./{name}", "max_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 2,
                     **training},
        "rollout_matching": {"decode_batch_size": 2, "max_new_tokens": 24},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stage2_run(assets):
    result = _run("train", str(_config(assets, "run_s2")))
    return assets / "run_s2", result


def test_invalid_config_exits_2_before_loading_anything(tmp_path, monkeypatch):
    import coordexp.runtime.train.launch as launch

    def must_not_run(*args, **kwargs):
        raise AssertionError("the model was loaded for an invalid config")

    monkeypatch.setattr(launch, "load_policy", must_not_run)
    monkeypatch.setattr(launch, "build_trainer", must_not_run)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"extends": str(EXAMPLES / "demo_stage2.yaml"), "training": {"max_stepz": 3}}))
    result = _run("train", str(bad))
    assert result.exit_code == 2
    assert "training.max_stepz" in result.output
    assert "Nothing was loaded" in result.output


def test_valid_tiny_stage2_trains_saves_and_summarises(stage2_run):
    out_dir, result = stage2_run
    assert result.exit_code == 0, result.output
    assert (out_dir / "model.safetensors").is_file() and (out_dir / "config.json").is_file()
    assert (out_dir / "tokenizer.json").is_file()  # the saved model loads like any checkpoint
    assert "run summary" in result.output
    assert re.search(r"│ steps\s*│\s*2 │", result.output), result.output
    assert "match rate" in result.output
    assert f"model saved to {out_dir}" in result.output.replace("\n", "")
    # not a TTY: one plain progress line per logging step (logging_steps 1, max_steps 2)
    progress = re.findall(r"step (\d+/2)  loss \S+  parse valid \S+  match", result.output)
    assert progress == ["1/2", "2/2"]


def test_show_rollouts_renders_the_logged_rollouts(stage2_run, tmp_path):
    from PIL import Image

    out_dir, result = stage2_run
    assert result.exit_code == 0, result.output
    logged = (out_dir / "rollouts.jsonl").read_text().splitlines()
    assert logged  # logging_steps 1: every step's rollouts are logged
    shown = _run("show-rollouts", str(out_dir), "--out", str(tmp_path / "png"), "--limit", "3")
    assert shown.exit_code == 0, shown.output
    paths = [Path(line) for line in shown.output.split()]
    assert len(paths) == min(3, len(logged))
    for path in paths:
        assert path.parent == tmp_path / "png"
        with Image.open(path) as image:
            # 112 px upscaled to the legible minimum canvas side, under a caption band (image, step, raw text)
            assert image.size[0] == 672 and image.size[1] > 672


def test_show_rollouts_without_a_log_exits_2(tmp_path):
    result = _run("show-rollouts", str(tmp_path))
    assert result.exit_code == 2
    assert "no rollouts.jsonl" in result.output


def test_stage1_json_summary_and_resume_auto(assets):
    config = _config(assets, "run_s1", max_steps=1, save_steps=1)
    data = yaml.safe_load(config.read_text())
    data["custom"] = {"trainer_variant": "stage1_sft"}
    data["training"]["packing"] = False
    config.write_text(yaml.safe_dump(data))
    result = _run("train", str(config), "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["steps"] == 1 and summary["global_step"] == 1
    assert summary["final_loss"] > 0 and summary["rollout"] == {}  # stage 1 has no rollouts
    assert summary["evaluations"] == [] and summary["last_eval"] is None  # no data.val_jsonl: no evaluation
    assert summary["output_dir"] == str(assets / "run_s1")
    assert (assets / "run_s1" / "checkpoint-1").is_dir()
    from coordexp.cli.train import resolve_resume

    assert Path(resolve_resume("auto", str(assets / "run_s1"))) == assets / "run_s1" / "checkpoint-1"
    assert resolve_resume(None, str(assets / "run_s1")) is None
    resumed = _run("train", str(config), "--resume", "auto", "--json")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout[resumed.stdout.index("{"):])["global_step"] >= 1


def test_resume_auto_without_checkpoint_and_missing_model_exit_2(assets, tmp_path):
    config = _config(assets, "never_run")
    result = _run("train", str(config), "--resume", "auto")
    assert result.exit_code == 2
    assert "found no checkpoint" in result.output
    data = yaml.safe_load(config.read_text())
    data["model"]["path"] = "./no-such-model"
    config.write_text(yaml.safe_dump(data))
    result = _run("train", str(config))
    assert result.exit_code == 2
    assert "does not exist" in result.output and "make-tiny-model" in result.output
    assert "Traceback" not in result.output and "bug in coordexp" not in result.output


# -- progress callback (pure parts and rank / TTY behaviour) --------------------------------------------------


def test_snapshot_from_logs_computes_rates_from_counts():
    from coordexp.runtime.train.progress import ProgressSnapshot, snapshot_from_logs

    logs = {"loss": 1.5, "tokens/trained": 1000.0, "packing/fill_ratio": 0.5, "rollout/pred_valid": 3.0,
            "rollout/pred_parsed": 4.0, "rollout/match_rate": 0.25, "rollout/gt_objects": 8.0,
            "rollout/fn_appended": 6.0}
    s = snapshot_from_logs(ProgressSnapshot(), logs, step=3, max_steps=10, seconds=2.0)
    assert (s.step, s.max_steps, s.loss, s.parse_valid_rate, s.match_rate) == (3, 10, 1.5, 0.75, 0.25)
    assert (s.fn_appended, s.fill_ratio, s.tokens_per_s) == (6.0, 0.5, 500.0)
    # a window with nothing parsed has no parse rate (undefined, not 0); the previous loss is replaced
    s2 = snapshot_from_logs(s, {"loss": 1.0, "rollout/pred_valid": 0.0, "rollout/pred_parsed": 0.0}, step=4,
                            max_steps=10, seconds=None)
    assert s2.parse_valid_rate is None and s2.loss == 1.0 and s2.tokens_per_s == 500.0


def test_format_log_line_is_plain_marks_missing_values_and_drops_columns_that_cannot_fill():
    from coordexp.runtime.train.progress import ProgressSnapshot, format_log_line

    line = format_log_line(ProgressSnapshot(step=5, max_steps=20, loss=0.12345, parse_valid_rate=0.8,
                                            tokens_per_s=1234.4, rollouts_seen=True, elapsed_s=65, eta_s=3725))
    assert line == ("step 5/20  loss 0.1235  parse valid 80.0%  match -  FN appended -  pred/GT -  dup/img -  "
                    "tok/s 1234  elapsed 1m05s  ETA 1h02m")
    stage1 = format_log_line(ProgressSnapshot(step=5, max_steps=20, loss=0.5, fill_ratio=0.9))
    assert stage1 == "step 5/20  loss 0.5000  fill 90.0%  tok/s -  elapsed -  ETA -"  # no rollout columns


class _State:
    def __init__(self, step: int, rank0: bool):
        self.global_step, self.max_steps, self.is_world_process_zero = step, 4, rank0


@pytest.mark.parametrize("rank0", [True, False])
def test_callback_prints_one_line_per_log_on_rank_zero_only(rank0):
    from rich.console import Console

    from coordexp.runtime.train.progress import ProgressCallback

    buffer = io.StringIO()
    callback = ProgressCallback(Console(file=buffer, force_terminal=False, width=200))
    assert callback.use_live is False
    callback.on_train_begin(None, _State(0, rank0), None)
    callback.on_log(None, _State(1, rank0), None, logs={"loss": 2.0, "tokens/trained": 10.0})
    callback.on_log(None, _State(1, rank0), None, logs={"eval/match_rate": 0.5, "eval/AP50": 0.25,
                                                        "eval/pred_valid": 3.0, "eval/pred_parsed": 4.0})
    callback.on_log(None, _State(2, rank0), None, logs={"loss": 1.0})
    callback.on_train_end(None, _State(2, rank0), None)
    lines = buffer.getvalue().splitlines()
    if rank0:
        assert [line.split()[:4] for line in lines] == [["step", "1/4", "loss", "2.0000"],
                                                        ["eval", "step", "1", "AP50"], ["step", "2/4", "loss", "1.0000"]]
        assert lines[1] == "eval  step 1  AP50 25.0%  parse valid 75.0%  match 50.0%"  # percent, as coordexp eval
        assert "elapsed" in lines[2] and "ETA" in lines[2]
    else:
        assert lines == []
    assert callback.snapshot.loss == 1.0  # every rank keeps the numbers; only rank 0 shows them


def test_callback_live_mode_renders_a_table_on_a_terminal():
    from rich.console import Console

    from coordexp.runtime.train.progress import ProgressCallback

    buffer = io.StringIO()
    callback = ProgressCallback(Console(file=buffer, force_terminal=True, width=160), title="stage 2")
    assert callback.use_live is True
    callback.on_train_begin(None, _State(0, True), None)
    callback.on_log(None, _State(1, True), None, logs={"loss": 0.5, "rollout/pred_valid": 1.0,
                                                       "rollout/pred_parsed": 2.0})
    callback.on_log(None, _State(1, True), None, logs={"eval/AP50": 0.125, "eval/token_acc": 0.5})
    callback.on_train_end(None, _State(1, True), None)
    text = buffer.getvalue()
    assert "stage 2" in text and "parse valid" in text and "50.0%" in text and "0.5000" in text
    assert "eval  step 1  AP50 12.5%  parse valid -  match -  token acc 50.0%" in text  # under the live table


@pytest.mark.parametrize("width", [80, 200])
def test_the_live_stage2_table_fits_the_terminal_whole(width):
    """Issue 55: at 80 columns every cell of the stage-2 live table was cut to '…'. Under the width the whole
    table needs, the narrower table (health and time left) shows each value whole; a wide terminal keeps every
    column. Large values (a long run, a slow step) are the hard case."""
    from rich.console import Console

    from coordexp.runtime.train.progress import ProgressCallback, ProgressSnapshot

    console = Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)
    callback = ProgressCallback(console, live=False, title="stage2_rollout_aligned: my_config.yaml")
    callback.snapshot = ProgressSnapshot(step=12345, max_steps=20000, loss=12.3456, parse_valid_rate=1.0,
                                         match_rate=0.987, fn_appended=1234, fill_ratio=0.99, pred_per_gt=12.34,
                                         duplicates_per_image=10.5, tokens_per_s=123456, elapsed_s=30 * 3600,
                                         eta_s=99 * 3600, rollouts_seen=True)
    console.print(callback.renderable())
    text = console.file.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    for value in ("12345/20000", "12.3456", "100.0%", "98.7%", "12.34", "10.50", "123456", "99h00m",
                  "stage2_rollout_aligned: my_config.yaml"):
        assert value in text
    assert ("FN appended" in text and "30h00m" in text) == (width == 200)  # what the narrow table leaves out


def test_plain_lines_never_wrap_on_a_narrow_pipe():
    """A pipe's console is 80 columns: a stage-2 line is longer and used to end in a bare-number line."""
    from rich.console import Console

    from coordexp.runtime.train.progress import ProgressCallback

    buffer = io.StringIO()
    callback = ProgressCallback(Console(file=buffer, force_terminal=False, width=40))
    callback.on_train_begin(None, _State(0, True), None)
    callback.on_log(None, _State(1, True), None, logs={"loss": 0.5, "tokens/trained": 5449.0,
                                                       "rollout/pred_valid": 1.0, "rollout/pred_parsed": 2.0})
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("step 1/4") and "tok/s" in lines[0]


def test_summarize_history_sums_the_whole_run_and_keeps_each_evaluation():
    """A stage-2 run that appended FNs early and ended on a ground-truth step shows the run's FNs, not 0."""
    from coordexp.runtime.train.progress import summarize_history

    history = [
        {"loss": 3.0, "step": 1, "rollout/pred_valid": 1.0, "rollout/pred_parsed": 4.0, "rollout/matched": 1.0,
         "rollout/gt_objects": 10.0, "rollout/fn_appended": 9.0, "rollout/fp": 2.0, "rollout/match_rate": 0.1},
        {"loss": 2.5, "step": 2, "rollout/pred_valid": 3.0, "rollout/pred_parsed": 4.0, "rollout/matched": 5.0,
         "rollout/gt_objects": 10.0, "rollout/fn_appended": 10.0, "rollout/fp": 1.0, "rollout/match_rate": 0.5},
        {"eval/AP50": 0.4, "eval/pred_valid": 9.0, "eval/pred_parsed": 10.0, "eval/match_rate": 0.6,
         "eval/token_acc": 0.9, "step": 2},
        {"loss": 2.0, "step": 3},  # a ground-truth step: no rollouts
        # the last, partial window (trainer.log logs it before the end-of-training entry): counted too
        {"window": "final", "step": 4, "rollout/pred_valid": 2.0, "rollout/pred_parsed": 2.0, "rollout/matched": 2.0,
         "rollout/gt_objects": 2.0, "rollout/fn_appended": 0.0, "rollout/fp": 0.0, "rollout/samples": 1.0},
        {"train_runtime": 1.0, "step": 4},
    ]
    summary = summarize_history(history)
    assert (summary["steps"], summary["first_loss"], summary["final_loss"]) == (4, 3.0, 2.0)
    assert summary["rollout"]["fn_appended"] == 19.0 and summary["rollout"]["fp"] == 3.0
    assert summary["parse_valid_rate"] == 0.6 and summary["match_rate"] == pytest.approx(8 / 22)
    assert summary["pred_per_gt"] == pytest.approx(6 / 22)
    assert summary["last_eval"] == {"step": 2, "AP50": 0.4, "parse_valid_rate": 0.9, "match_rate": 0.6,
                                    "token_acc": 0.9, "precision": None, "recall": None, "f1": None}
    assert summary["evaluations"] == [summary["last_eval"]]
    assert summarize_history([]) == {"steps": 0, "first_loss": None, "final_loss": None, "rollout": {},
                                     "collapse_alarms": [], "evaluations": [], "last_eval": None}


def test_eval_line_shows_the_set_figures_and_the_progress_line_the_collapse_figures():
    from coordexp.runtime.train.progress import ProgressSnapshot, eval_figures, format_eval_line, snapshot_from_logs

    figures = eval_figures({"eval/AP50": 0.5, "eval/precision": 0.8, "eval/recall": 0.6, "eval/f1": 0.685714,
                            "eval/match_rate": 0.7}, 10)
    assert format_eval_line(figures) == ("eval  step 10  AP50 50.0%  P 80.0%  R 60.0%  F1 68.6%  parse valid -  "
                                         "match 70.0%")
    snapshot = snapshot_from_logs(ProgressSnapshot(), {"loss": 1.0, "rollout/pred_per_gt": 3.05,
                                                       "rollout/duplicates_per_image": 1.5}, step=3, max_steps=9,
                                  seconds=None)
    assert (snapshot.pred_per_gt, snapshot.duplicates_per_image) == (3.05, 1.5)


def test_summary_table_shows_the_last_evaluation():
    from coordexp.cli.train import _summary_rows

    rows = dict(_summary_rows({"steps": 4, "final_loss": 1.0, "rollout": {},
                               "last_eval": {"step": 4, "AP50": 0.5, "parse_valid_rate": None, "match_rate": 0.25,
                                             "token_acc": None}}))
    assert rows["eval at step 4: AP50"] == "50.0%" and rows["eval at step 4: match"] == "25.0%"  # one unit
    assert rows["eval at step 4: parse valid"] == "-" and "eval at step 4: token acc" not in rows
