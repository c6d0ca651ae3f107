"""Issue 52 acceptance: a short stage-2 run with ``rollout_matching.objective: reward`` on the tiny model (CPU, HF
rollouts) trains, and every step's log line in ``trainer_state.json`` carries the reward figures."""

from __future__ import annotations

import json
import math

import pytest

from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput
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
        split = [log[k] for k in ("reward/entropy_coord", "reward/entropy_text") if k in log]
        assert split and all(v >= 0 for v in split)  # the types trained in the window, each its token mean
        if credit == "object":
            assert "loss/sft" in log  # sft_weight > 0 adds the rollout-matching target of the same rollouts


class _ScriptedBackend(RolloutBackend):
    """Rollouts that differ within a group (an odd seed writes the first object only, an even seed every object),
    so the trainer's reward path has non-zero advantages to train on (the random tiny model writes no JSON)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def from_run(cls, run, model, processor):
        return cls(processor.tokenizer)

    def generate(self, requests):
        outputs = []
        for request in requests:
            objects = request.record.objects[:1] if request.seed % 2 else request.record.objects
            text = serialize_objects(objects)
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            outputs.append(RolloutOutput(tuple(request.prompt.input_ids.tolist()), ids, text, "stop"))
        return outputs


@pytest.mark.parametrize("kl_weight", [0.0, 0.5])
def test_rollouts_that_differ_train_the_policy_through_the_trainer(tmp_path, write_config, monkeypatch, kl_weight):
    """With ``kl_weight > 0`` the frozen starting model is the reference: the first step's policy is that model
    (k3 = 0), the last step's has moved (k3 > 0; the example's first step runs at learning rate 0)."""
    import coordexp.runtime.train.launch as launch

    monkeypatch.setattr(launch, "create_backend", lambda run, model, processor: _ScriptedBackend.from_run(
        run, model, processor))
    run = load_contract(write_config({
        "training": {"output_dir": str(tmp_path / "run"), "per_device_train_batch_size": 2,
                     "gradient_accumulation_steps": 1, "max_steps": STEPS + 1, "logging_steps": 1,
                     "save_steps": 1000, "packing": False, "learning_rate": 1e-3},
        "global_max_length": 1024,
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 8, "objective": "reward",
                             "decoding": {"temperature": 1.0}, "gt_step_share": 0.0,
                             "reward": {"group_size": 4, "credit": "object", "kl_weight": kl_weight}},
    }))
    outcome = run_training(run)
    assert outcome.global_step == STEPS + 1
    state = json.loads((outcome.output_dir / "trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "loss" in h and "reward/mean" in h]
    assert len(steps) == STEPS + 1
    for log in steps:
        assert log["reward/zero_advantage_group_share"] < 1.0 and log["reward/group_std"] > 0
        assert log["loss/policy_gradient"] != 0.0 and log["grad_norm"] > 0
        assert log["reward/closing_advantage"] is not None and log["rollout/eos_stopped"] == 8
    if kl_weight:
        assert abs(steps[0]["loss/kl"]) < 1e-6 < steps[-1]["loss/kl"]
    else:
        assert "loss/kl" not in steps[0]
