"""Issue 28 items 3 and 4 end to end: ``coordexp train`` (stage 1, tiny model, a few steps) with
``metric_for_best_model: token_acc``, ``token_type_metrics: true`` and ``object_order: random`` logs the per-type
figures every step, reports the teacher-forced figures at every evaluation next to AP, and keeps the checkpoint of
the best token accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.runtime.train import checkpoints

pytestmark = pytest.mark.slow
runner = CliRunner()
STEPS = 3


def test_token_accuracy_is_reported_and_picks_the_best_checkpoint(tmp_path, write_config, dataset):
    run = tmp_path / "run"
    config = write_config({
        "custom": {"trainer_variant": "stage1_sft"}, "global_max_length": 1024,
        "data": {"val_jsonl": str(dataset.val_jsonl), "max_val_samples": 2, "object_order": "random"},
        "rollout_matching": {"max_new_tokens": 8, "decode_batch_size": 2},
        "training": {"output_dir": str(run), "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2,
                     "packing": False, "gradient_accumulation_steps": 1, "logging_steps": 1, "learning_rate": 3e-3,
                     "max_steps": STEPS, "save_steps": 1, "eval_steps": 1, "save_total_limit": 2,
                     "metric_for_best_model": "token_acc", "token_type_metrics": True},
    })
    result = runner.invoke(app, ["train", str(config), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    state = json.loads((run / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    history = state["log_history"]
    steps = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval/token_acc" in h]
    assert len(steps) == STEPS and len(evals) == STEPS
    for h in steps:  # per logging step: accuracy in [0, 1], cross-entropy > 0, for each token type
        for kind in ("", "text_", "coord_"):
            assert 0.0 <= h[f"{kind}token_acc"] <= 1.0 and h[f"{kind}token_loss"] > 0.0
        # stage 1 weighs every text token 1 and a step is one micro-step: token_ce is the text tokens' mean CE
        assert h["text_token_loss"] == pytest.approx(h["loss/token_ce"], rel=1e-4)
    for h in evals:
        assert "eval/AP50" in h and {"eval/text_token_acc", "eval/coord_token_loss"} <= set(h)
        # the set figures of the evaluation's rollouts (issue 42), fractions like AP
        assert 0.0 <= h["eval/recall"] <= 1.0 and 0.0 <= h["eval/recall_any_class"] <= 1.0
        assert h["eval/count_error"] >= 0.0 and h["eval/duplicates_per_image"] >= 0.0
        assert all(0.0 <= h[k] <= 1.0 for k in ("eval/precision", "eval/f1") if k in h)  # undefined: nothing written
    # HF keeps the first step with the highest eval_token_acc (greater_is_better defaults to true for it)
    values = [h["eval/token_acc"] for h in evals]
    best_step = evals[values.index(max(values))]["step"]
    assert state["best_metric"] == pytest.approx(max(values))
    best = Path(state["best_model_checkpoint"])
    assert best == run / f"checkpoint-{best_step}" and best.is_dir() and checkpoints.checkpoint_problem(best) is None
    kept = sorted(p.name for p in run.glob("checkpoint-*"))
    assert best.name in kept and f"checkpoint-{STEPS}" in kept and len(kept) <= 2


def test_the_cost_benchmark_runs_and_reports_its_ratios():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_token_figures.py"), "--vocab", "4000",
                          "--rows", "64", "--val", "2", "--repeats", "1", "--max-new-tokens", "8", "--hidden", "64"],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("JSON ")]
    summary = json.loads(line[len("JSON "):])
    for part, (a, b) in (("rows", ("token_figures_s", "objective_s")), ("eval", ("teacher_forced_s",
                                                                                "rollout_eval_s"))):
        figures = summary[part]
        assert figures[a] > 0 and figures[b] > 0 and figures["ratio"] == pytest.approx(figures[a] / figures[b])
    assert summary["eval"]["records"] == 2
