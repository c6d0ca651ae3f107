"""Stage 2 end to end on CPU: rollouts -> Y_train -> (packed) forward -> loss, counters that add up."""

from __future__ import annotations

import json
import math

import pytest

from coordexp.runtime.train.launch import build_trainer, run_training
from coordexp.runtime.train.visualize import read_rollout_log
from coordexp.schema.contract import load_contract

pytestmark = pytest.mark.slow

STEPS = 2


def _stage2_overrides(tmp_path, packing: bool) -> dict:
    return {
        "training": {
            "output_dir": str(tmp_path / "run"),
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "max_steps": STEPS,
            "logging_steps": 1,
            "save_steps": 1000,
            "packing": packing,
            "packing_drop_last": True,
            "packing_buffer": 64,
            "learning_rate": 1e-3,
        },
        "global_max_length": 1024,
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 2, "max_new_tokens": 24},
    }


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_stage2_trains_with_counters_that_add_up(tmp_path, write_config, packing):
    run = load_contract(write_config(_stage2_overrides(tmp_path, packing)))
    outcome = run_training(run, rollout_log_every=1)
    assert outcome.global_step == STEPS
    step_logs = [h for h in outcome.log_history if "loss" in h and "rollout/samples" in h]
    assert len(step_logs) == STEPS
    entries = read_rollout_log(outcome.output_dir)
    for log in step_logs:
        assert math.isfinite(log["loss"]) and log["loss"] > 0
        assert log["rollout/samples"] == 4  # batch 2 x accumulation 2
        assert log["rollout/matched"] + log["rollout/fn_appended"] == log["rollout/gt_objects"]
        assert log["rollout/pred_valid"] + log["rollout/pred_dropped"] == log["rollout/pred_parsed"]
        # the counters describe exactly the logged rollouts of that step (the log is written at the pre-update step)
        logged = [e for e in entries if e.step == log["step"] - 1]
        assert len(logged) == 4
        assert sum(len(e.gt) for e in logged) == log["rollout/gt_objects"]
        assert sum(len(e.predictions) for e in logged) == log["rollout/pred_valid"]
        assert sum(len(e.pairs) for e in logged) == log["rollout/matched"]
        if packing:
            assert 0 < log["packing/fill_ratio"] <= 1
            assert log["tokens/computed"] == log["tokens/trained"]  # padding-free rows
        else:
            assert "packing/fill_ratio" not in log
            assert log["tokens/computed"] >= log["tokens/trained"]  # every row padded to the longest of its batch
    if not packing:  # 2-sample micro-batches of different lengths pad somewhere
        assert any(log["tokens/computed"] > log["tokens/trained"] for log in step_logs)
    assert (outcome.output_dir / "config.json").is_file()
    assert (outcome.output_dir / "tokenizer.json").is_file()


def test_offload_is_a_no_op_outside_vllm_colocate(tmp_path, write_config):
    overrides = _stage2_overrides(tmp_path, packing=True)
    overrides["rollout_matching"] = {
        **overrides["rollout_matching"],
        "offload": {"enabled": True, "offload_model": True, "offload_optimizer": True},
    }
    run = load_contract(write_config(overrides))
    assert run.rollout_matching.offload_active is False
    trainer = build_trainer(run)
    params_before = {n: p.device for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert {n: p.device for n, p in trainer.model.named_parameters()} == params_before


def test_stage1_loss_decreases(tmp_path, write_config):
    overrides = {
        "custom": {"trainer_variant": "stage1_sft", "object_field_order": "desc_first"},
        "training": {
            "output_dir": str(tmp_path / "s1"),
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "max_steps": 12,
            "logging_steps": 1,
            "save_steps": 1000,
            "learning_rate": 3e-3,
            "warmup_ratio": 0.0,
            "lr_scheduler_type": "constant",
            "packing": True,
            "packing_buffer": 64,
        },
        "global_max_length": 2048,
    }
    outcome = run_training(load_contract(write_config(overrides)))
    losses = [h["loss/token_ce"] for h in outcome.log_history if "loss/token_ce" in h]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, json.dumps(losses)


def test_label_drafts_leave_stage2_unchanged(tmp_path, write_config):
    """Seeded sampling rollouts with and without label drafts: the same rollouts.jsonl and the same losses (drafts
    change how many forwards a rollout takes, never its tokens); the drafted run's metadata says drafts ran."""
    runs = {}
    for drafts in (False, True):
        overrides = _stage2_overrides(tmp_path / str(drafts), packing=False)
        overrides["rollout_matching"].update({"decoding": {"temperature": 1.0},
                                              "hf_generate": {"label_drafts": drafts, "draft_tokens": 4}})
        outcome = run_training(load_contract(write_config(overrides, name=f"drafts_{drafts}.yaml")),
                               rollout_log_every=1)
        metadata = [json.loads(line) for line in (outcome.output_dir / "run_metadata.jsonl").read_text().splitlines()]
        runs[drafts] = (read_rollout_log(outcome.output_dir), [h["loss"] for h in outcome.log_history if "loss" in h],
                        [m for m in metadata if "label_drafts" in json.dumps(m.get("backend", {}))])
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 4 * STEPS
    assert runs[True][1] == runs[False][1] and len(runs[True][1]) == STEPS
    assert runs[False][2] == [] and len(runs[True][2]) >= STEPS
