"""Upstream CoordExp's later stage 2 as its user has it (``stage2_two_channel``, ``stage2_ab.pipeline``, artifact
roots; tests/schema/test_migrate_two_channel.py checks the mapping): ``coordexp migrate -o``, then ``coordexp
train`` on the tiny Qwen3-VL. The run writes where upstream's loader would have (output_root/artifact_subdir),
trains ground-truth steps and rollout steps in the b_ratio it was given, and its loss has the migrated modules."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app

pytestmark = pytest.mark.slow
runner = CliRunner()


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def test_a_two_channel_stage2_migrates_and_trains_both_kinds_of_step(tmp_path, qwen3_model_dir):
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    root = tmp_path / "upstream"
    shutil.copytree(qwen3_model_dir, root / "model_cache" / "Qwen3-VL-tiny-coordexp")
    write_synthetic_dataset(root / "public_data" / "shapes", n_train=4, n_val=2, seed=5)
    _write(root / "configs" / "base.yaml", {
        "model": {"torch_dtype": "float32", "attn_impl": "sdpa"},
        "template": {"template": "qwen3_vl", "max_pixels": 16384, "truncation_strategy": "raise"},
        "training": {"output_root": "./output", "logging_root": "./tb", "add_version": True, "report_to": ["none"],
                     "seed": 17, "learning_rate": 1e-4, "warmup_ratio": 0.0},
        "custom": {"json_format": "standard"},
    })
    coord = {"coord_ce_weight": 1.0, "coord_gate_weight": 5.0, "text_gate_weight": 0.0, "soft_ce_weight": 1.0,
             "w1_weight": 1.0, "temperature": 0.9, "target_sigma": 1.5, "target_truncate": 8,
             "adjacent_repulsion_weight": 0.0}
    leaf = _write(root / "configs" / "stage2_two_channel" / "tiny.yaml", {
        "extends": "../base.yaml",
        "global_max_length": 1024,
        "model": {"model": "model_cache/Qwen3-VL-tiny-coordexp"},
        "tuner": {"train_type": "full", "freeze_vit": True, "freeze_aligner": True},
        "custom": {"trainer_variant": "stage2_two_channel", "train_jsonl": "public_data/shapes/train.jsonl"},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}, "pipeline": {"objective": [
            {"name": "token_ce", "enabled": True, "weight": 1.0, "channels": ["A", "B"],
             "application": {"preset": "anchor_text_only"},
             "config": {"desc_ce_weight": 1.0, "rollout_fn_desc_weight": 1.0,
                        "rollout_global_prefix_struct_ce_weight": 1.0}},
            {"name": "loss_duplicate_burst_unlikelihood", "enabled": True, "weight": 1.0, "channels": ["B"],
             "config": {}},
            {"name": "coord_reg", "enabled": True, "weight": 1.0, "channels": ["A", "B"], "config": coord},
        ], "diagnostics": []}},
        "rollout_matching": {"rollout_backend": "hf", "channel_b_decode_batch_size": 2, "max_new_tokens": 24,
                             "decode_mode": "greedy"},
        "training": {"artifact_subdir": "stage2_ab/tiny", "max_steps": 4, "logging_steps": 1, "save_steps": 100,
                     "per_device_train_batch_size": 2, "effective_batch_size": 2, "packing": False},
    })
    out = tmp_path / "migrated.yaml"
    migrated = runner.invoke(app, ["migrate", str(leaf), "-o", str(out), "--base-dir", str(root)],
                             catch_exceptions=False)
    assert migrated.exit_code == 2, migrated.output  # the duplicate-burst term and the presets were left out: said
    assert "loss_duplicate_burst_unlikelihood" in " ".join(migrated.output.split())

    result = runner.invoke(app, ["train", str(out), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["global_step"] == 4
    run_dir = root / "output" / "stage2_ab" / "tiny"  # upstream's loader joined output_root and artifact_subdir
    assert Path(summary["output_dir"]) == run_dir and (run_dir / "config.json").is_file()
    from coordexp.runtime.train.curves import find_trainer_state

    history = json.loads(find_trainer_state(run_dir).read_text())["log_history"]
    logs = [log for log in history if "loss" in log]
    gt_steps = [log.get("stage2/gt_micro_steps", 0) for log in logs]
    assert 0 < sum(gt_steps) < len(logs)  # b_ratio 0.5: ground-truth steps and rollout steps, both
    assert all("loss/coord_reg" in log and "loss/token_ce" in log for log in logs)
