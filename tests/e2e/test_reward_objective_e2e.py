"""Issue 52 acceptance: a short stage-2 run with ``rollout_matching.objective: reward`` on the tiny model (CPU, HF
rollouts) trains, and every step's log line in ``trainer_state.json`` carries the reward figures."""

from __future__ import annotations

import json
import math

import pytest

from coordexp.runtime.train.launch import run_training
from coordexp.schema.contract import load_contract

pytestmark = pytest.mark.slow

STEPS = 2
GROUP = 3


@pytest.mark.parametrize("credit,packing", [("object", True), ("sequence", False)])
def test_reward_objective_trains_and_logs_its_figures(tmp_path, write_config, credit, packing):
    run = load_contract(write_config({
        "training": {"output_dir": str(tmp_path / "run"), "per_device_train_batch_size": 2,
                     "gradient_accumulation_steps": 1, "max_steps": STEPS, "logging_steps": 1, "save_steps": 1000,
                     "packing": packing, "packing_drop_last": True, "packing_buffer": 64, "learning_rate": 1e-3},
        "global_max_length": 1024,
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 6, "max_new_tokens": 24,
                             "objective": "reward", "decoding": {"temperature": 1.0},
                             "reward": {"group_size": GROUP, "include_greedy": credit == "object",
                                        "credit": credit, "sft_weight": 0.5 if credit == "object" else 0.0}},
    }))
    outcome = run_training(run)
    assert outcome.global_step == STEPS
    state = json.loads((outcome.output_dir / "trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "loss" in h and "reward/mean" in h]
    assert len(steps) == STEPS
    per_image = GROUP + (credit == "object")
    for log in steps:
        assert log["rollout/samples"] == 2 * per_image  # every rollout of the group is a counted sample
        assert log["reward/groups"] == 2 and log["reward/samples"] == 2 * per_image
        for key in ("reward/mean", "reward/group_std", "reward/advantage_mean", "reward/samples_per_s",
                    "loss/policy_gradient", "loss/policy_gradient/entropy"):
            assert math.isfinite(log[key]), key
        assert 0.0 <= log["reward/zero_advantage_group_share"] <= 1.0
        assert log["reward/group_std"] >= 0 and log["reward/samples_per_s"] > 0
        assert log["loss/policy_gradient/entropy"] > 0
        if credit == "object":
            assert "loss/sft" in log  # sft_weight > 0 adds the rollout-matching target of the same rollouts
