"""The collapse alarm in a real stage-2 run (issue 42): a bound the tiny model's rollouts cross at once
(truncation, with 8 new tokens an answer never closes) stops the run at the first logging window with a
checkpoint, the reason in the run log and the checkpoint's trainer_state.json. A stop is no success (issue 56, item
5): exit 2 naming the step and the checkpoint, and the collapsed weights are not written as the final model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.runtime.train.run_log import read_run_log

pytestmark = pytest.mark.slow
runner = CliRunner()


def test_a_crossed_bound_stops_the_run_with_a_checkpoint_and_says_why(tmp_path, write_config):
    run = tmp_path / "run"
    config = write_config({
        "rollout_matching": {"max_new_tokens": 8, "decode_batch_size": 2,
                             "collapse_alarm": {"action": "stop", "cut_off_rate_max": 0.0,
                                                "min_gt_objects": 0}},  # 2-image windows
        "training": {"output_dir": str(run), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
                     "logging_steps": 1, "max_steps": 3, "save_steps": 100},
    })
    result = runner.invoke(app, ["train", str(config), "--json"], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    text = " ".join(result.stderr.split())
    assert "stopped the run at step 1" in text and "checkpoint-1" in text and "no final model" in text
    assert not (run / "config.json").exists() and not (run / "model.safetensors").exists()
    assert (run / "checkpoint-1").is_dir() and not (run / "checkpoint-2").exists()
    events = read_run_log(run, event="collapse_alarm")
    assert [e["step"] for e in events] == [1]
    history = json.loads((run / "checkpoint-1" / "trainer_state.json").read_text())["log_history"]
    alarms = [h for h in history if "collapse_alarm" in h]
    assert len(alarms) == 1 and alarms[0]["step"] == 1 and alarms[0]["action"] == "stop"
    assert "cut off" in alarms[0]["collapse_alarm"]
    window = next(h for h in history if "loss" in h)
    assert window["rollout/cut_off_rate"] == 1.0 and window["rollout/pred_per_gt"] >= 0.0
    assert "collapse alarm at step 1" in result.stderr
