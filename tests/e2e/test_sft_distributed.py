"""Stage 1 and stage 2's rollout-matching SFT train the same under DDP and ZeRO-2 as in one process at the global
batch (docs/design.md, decision 19's "Built since"): every loss term divides by the micro-step's counts summed over
all ranks, each rank's term times the world size (the ranks' gradients are averaged), so a rank whose targets are
shorter (fewer objects, an early stop) no longer weighs as much as one whose targets are long.

One process at batch 2b against two torchrun ranks (gloo on CPU) at batch b, same records, seeds and steps; packing
off (each rank's carry buffer trains its own segments, so packed steps differ by design). The reward objective's
policy gradient has its own test (tests/e2e/test_reward_distributed.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from testkit import assert_ranks_train_like_one_process, train_in_process, torchrun_two_ranks

pytestmark = pytest.mark.slow

PER_RANK = 2  # images per rank and micro-step (b); the one process trains 2b
TRAINING = {"gradient_accumulation_steps": 2, "max_steps": 2, "logging_steps": 1, "save_steps": 1000,
            "packing": False, "warmup_ratio": 0.0, "learning_rate": 1.0e-3}
LOGGED = ("loss", "grad_norm", "loss/token_ce", "loss/coord_reg", "loss/coord_reg/soft_ce", "loss/coord_reg/w1",
          "tokens/trained")
STAGE1 = {"custom": {"trainer_variant": "stage1_sft"}}
STAGE2 = {"rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 4, "max_new_tokens": 24,
                               "gt_step_share": 0.0}}


@pytest.mark.parametrize("stage, overrides, engines", [
    ("stage1", STAGE1, (None, "zero2")),
    ("stage2", STAGE2, (None,)),
])
def test_sft_terms_under_ddp_and_zero2_train_like_one_process(tmp_path, write_config, stage, overrides, engines):
    def config(name: str, batch: int, deepspeed: str | None = None) -> tuple[Path, Path]:
        output = tmp_path / name
        training = {**TRAINING, "per_device_train_batch_size": batch, "output_dir": str(output)}
        if deepspeed is not None:
            training["deepspeed"] = deepspeed
        return write_config({**overrides, "global_max_length": 1024, "training": training}, name=f"{name}.yaml"), output

    single_config, _ = config("single", 2 * PER_RANK)
    single = train_in_process(single_config, tmp_path / "out_single")
    steps = TRAINING["max_steps"]
    assert single["global_step"] == steps and len(single["logs"]) == steps
    assert single["param_norms"] != single["initial_param_norms"]  # weights moved: else the comparison is empty

    for engine in engines:
        name = engine or "ddp"
        if engine and importlib.util.find_spec("deepspeed") is None:
            pytest.skip("deepspeed is not installed (bash scripts/install_deepspeed.sh): DDP checked, ZeRO-2 not")
        ranks_config, _ = config(name, PER_RANK, engine)
        ranks = torchrun_two_ranks(ranks_config, tmp_path / f"out_{name}")  # both ranks end with the same weights
        assert_ranks_train_like_one_process(single, ranks, LOGGED, f"{stage} {name}")
