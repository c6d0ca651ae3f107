"""A DeepSpeed run inside a process that goes on afterwards (a notebook, a benchmark, this test suite): the run must
hand the process back as it found it. CI once ran the plain stage-2 tests after tests/e2e/test_upstream_recipe.py
under that run's ZeRO-2 (accelerate's ACCELERATE_USE_DEEPSPEED and shared state, the single-process launcher
variables): 13 failures, and the processes those tests started inherited DeepSpeed; then destroying the world-of-1
process group broke the upstream recipe's resume, a second DeepSpeed run in the same process."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (bash scripts/install_deepspeed.sh)"),
]

PROCESS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_DEEPSPEED")
TRAINING = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 1, "logging_steps": 1,
            "save_steps": 1000, "packing": False}


def test_a_deepspeed_run_leaves_the_process_as_it_found_it(write_config, tmp_path):
    from transformers.integrations.deepspeed import deepspeed_config

    from coordexp.runtime.train.launch import build_trainer, run_training
    from coordexp.schema.contract import load_contract

    rollout = {"rollout_backend": "hf", "decode_batch_size": 2, "max_new_tokens": 8}
    before = {name: os.environ.get(name) for name in PROCESS_ENV}
    zero2 = write_config({"training": {**TRAINING, "output_dir": str(tmp_path / "zero2"), "deepspeed": "zero2"},
                          "rollout_matching": rollout}, name="zero2.yaml")
    outcome = run_training(load_contract(zero2), print_logs=False)
    assert outcome.global_step == 1
    assert {name: os.environ.get(name) for name in PROCESS_ENV} == before
    assert deepspeed_config() is None
    again = run_training(load_contract(zero2), print_logs=False)  # a second DeepSpeed run joins the process group
    assert again.global_step == 1

    plain = write_config({"training": {**TRAINING, "output_dir": str(tmp_path / "plain")}, "rollout_matching": rollout},
                         name="plain.yaml")
    trainer = build_trainer(load_contract(plain))
    try:
        assert trainer.accelerator.distributed_type.name != "DEEPSPEED"
        assert not trainer.is_deepspeed_enabled
    finally:
        trainer.backend.close()
