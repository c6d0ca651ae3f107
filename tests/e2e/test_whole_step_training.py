"""Stage 2 through the trainer: each optimizer step's rollouts are ONE backend call with unchanged results, and a
DoRA run's HF rollouts never run a LoRA/DoRA layer and leave the trained weights bit-identical."""

from __future__ import annotations

import json

import pytest
import torch

from coordexp.runtime.rollout.hf import HfRolloutBackend
from coordexp.runtime.train.launch import build_trainer
from coordexp.runtime.train.pipeline import MicroStepPipeline
from coordexp.runtime.train.run_log import run_log_path
from coordexp.schema.contract import load_contract

pytestmark = pytest.mark.slow

STEPS = 2


def _overrides(tmp_path, name: str, **extra) -> dict:
    overrides = {
        "training": {"output_dir": str(tmp_path / name), "per_device_train_batch_size": 2,
                     "gradient_accumulation_steps": 2, "max_steps": STEPS, "logging_steps": 1, "save_steps": 1000,
                     "packing": True, "packing_buffer": 64, "learning_rate": 1e-3},
        "global_max_length": 1024,
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 4, "max_new_tokens": 24},
    }
    overrides.update(extra)
    return overrides


def _rollout_log(output_dir) -> list[dict]:
    lines = run_log_path(output_dir).read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "rollout" and r.get("tag") == "train"]


def test_each_step_is_one_backend_call_and_the_run_is_what_per_micro_step_rollouts_give(
        tmp_path, write_config, monkeypatch):
    calls: list[int] = []
    real_generate = HfRolloutBackend.generate

    def counting(self, requests):
        calls.append(len(requests))
        return real_generate(self, requests)

    monkeypatch.setattr(HfRolloutBackend, "generate", counting)
    whole = build_trainer(load_contract(write_config(_overrides(tmp_path, "whole"), "whole.yaml")))
    whole.train()
    assert calls == [4] * STEPS  # gradient_accumulation_steps x batch prompts per call, one call per step

    calls.clear()
    monkeypatch.setattr(MicroStepPipeline, "plan", lambda self, step, batches, following: None)  # the old way
    alone = build_trainer(load_contract(write_config(_overrides(tmp_path, "alone"), "alone.yaml")))
    alone.train()
    assert calls == [2] * (2 * STEPS)

    def losses(trainer):
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    assert losses(whole) == pytest.approx(losses(alone), rel=1e-6)
    for mine, theirs in zip(_rollout_log(tmp_path / "whole"),
                            _rollout_log(tmp_path / "alone"), strict=True):
        assert (mine["global_step"], mine["micro_step"], mine["seeds"], mine["response_tokens"]) == (
            theirs["global_step"], theirs["micro_step"], theirs["seeds"], theirs["response_tokens"])


def test_a_dora_runs_rollouts_decode_merged_weights_and_leave_the_trained_weights_bit_identical(
        tmp_path, write_config, qwen3_model_dir, monkeypatch):
    from peft.tuners.lora import LoraLayer

    overrides = _overrides(tmp_path, "dora", tuner={"train_type": "lora", "use_dora": True, "lora_rank": 4,
                                                    "lora_alpha": 8})
    overrides["model"] = {"path": str(qwen3_model_dir)}
    trainer = build_trainer(load_contract(write_config(overrides, "dora.yaml")))
    policy = trainer.model
    layers = [m for m in policy.modules() if isinstance(m, LoraLayer)]
    assert layers and trainer.run.tuner.lora_dropout == 0.0  # DoRA's default: no dropout (one base matmul)
    state = {"rolling_out": False, "during": 0, "training": 0, "rollouts": 0}

    def hit(*_):
        state["during" if state["rolling_out"] else "training"] += 1

    handles = [m.register_forward_hook(hit) for m in layers]
    real_generate = HfRolloutBackend.generate

    def watched(self, requests):
        before = {n: p.detach().clone() for n, p in policy.named_parameters()}
        state["rolling_out"] = True
        try:
            outputs = real_generate(self, requests)
        finally:
            state["rolling_out"] = False
        for name, parameter in policy.named_parameters():
            assert torch.equal(parameter.detach().view(torch.int32), before[name].view(torch.int32)), name
        state["rollouts"] += 1
        return outputs

    monkeypatch.setattr(HfRolloutBackend, "generate", watched)
    try:
        trainer.train()
    finally:
        for handle in handles:
            handle.remove()
    assert state["rollouts"] == STEPS
    assert state["during"] == 0  # no LoRA/DoRA layer ran while decoding
    assert state["training"] > 0  # (the hooks do see the training forwards)
    assert trainer.backend.merged.merges == STEPS  # merged once per optimizer step's sync point
