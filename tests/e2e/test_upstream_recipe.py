"""Issue 20 acceptance, the upstream user's run end to end: an upstream-shaped ``extends`` chain (ms-swift spellings:
``model.model``, ``custom.train_jsonl`` relative to the launch directory, a DoRA ``tuner`` block, ``optimizer:
multimodal`` with ``vit_lr``/``aligner_lr``, ``cosine_warmup_with_min_lr``, ``effective_batch_size``, ZeRO-2 with
packing, ``custom.extra.rollout_matching``) goes through ``coordexp migrate -o``, then ``coordexp train`` on the tiny
Qwen3-VL: it trains stage 2, saves a DoRA adapter, resumes from it, and its optimizer has the three rates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app

pytestmark = pytest.mark.slow
pytest.importorskip("peft", reason="needs peft (pip install peft)")
runner = CliRunner()
LLM_LR, VIT_LR, ALIGNER_LR = 2e-4, 1e-4, 5e-4


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def _json(result) -> dict:
    return json.loads(result.stdout[result.stdout.index("{"):])


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def upstream_repo(tmp_path_factory, qwen3_model_dir):
    """A launch directory laid out like the upstream repository: the checkpoint under model_cache/, data under
    public_data/, and configs/base.yaml -> configs/dlora/sft_base.yaml -> configs/dlora/stage2.yaml."""
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    root = tmp_path_factory.mktemp("upstream_repo")
    shutil.copytree(qwen3_model_dir, root / "model_cache" / "Qwen3-VL-tiny-coordexp")
    write_synthetic_dataset(root / "public_data" / "shapes", n_train=6, n_val=2, seed=11)
    _write(root / "configs" / "base.yaml", {
        "model": {"torch_dtype": "float32", "attn_impl": "sdpa"},
        "template": {"template": "qwen3_vl", "max_pixels": 16384},
        "deepspeed": {"enabled": True, "config": "zero2"},
        "training": {"bf16": False, "seed": 17, "report_to": ["none"], "lr_scheduler_type": "cosine_warmup_with_min_lr",
                     "save_only_model": False, "logging_first_step": True},
        "custom": {"json_format": "standard", "dump_conversation_text": False},
    })
    _write(root / "configs" / "dlora" / "sft_base.yaml", {
        "extends": "../base.yaml",
        "model": {"model": "model_cache/Qwen3-VL-tiny-coordexp"},
        "tuner": {"train_type": "lora", "use_dora": True, "use_swift_lora": False, "freeze_llm": False,
                  "freeze_vit": False, "freeze_aligner": False, "target_modules": ["all-linear"],
                  "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_bias": "none"},
        "training": {"optimizer": "multimodal", "learning_rate": LLM_LR, "vit_lr": VIT_LR, "aligner_lr": ALIGNER_LR,
                     "weight_decay": 0.1, "warmup_ratio": 0.0, "lr_scheduler_kwargs": {"min_lr": 1e-6}},
        "custom": {"coord_soft_ce_w1": {"enabled": True, "soft_ce_weight": 1.0, "w1_weight": 1.0,
                                        "gate_weight": 1.0, "temperature": 1.0, "target_sigma": 2.0,
                                        "target_truncate": 16},
                   "augmentation": {"enabled": False, "bypass_prob": 0.1}},
    })
    leaf = _write(root / "configs" / "dlora" / "stage2.yaml", {
        "extends": "sft_base.yaml",
        "global_max_length": 1024,
        "custom": {"trainer_variant": "rollout_matching_sft",
                   "train_jsonl": "public_data/shapes/train.jsonl", "val_jsonl": "public_data/shapes/val.jsonl",
                   "extra": {"rollout_matching": {"rollout_backend": "hf", "rollout_generate_batch_size": 2,
                                                  "decode_mode": "greedy", "max_new_tokens": 24,
                                                  "temperature": 0.0, "fp_cost": 1, "fn_cost": 2,
                                                  "ot_epsilon": 10, "ot_iters": 3,
                                                  "desc_monitor": {"enabled": True, "mode": "exact"}}}},
        "training": {"output_dir": "output/stage2_dora", "max_steps": 2, "save_steps": 1, "logging_steps": 1,
                     "per_device_train_batch_size": 2, "effective_batch_size": 2, "packing": True,
                     "packing_buffer": 8, "save_delay_steps": 200},
    })
    return root, leaf


@pytest.fixture(scope="module")
def migrated(upstream_repo, tmp_path_factory):
    root, leaf = upstream_repo
    out = tmp_path_factory.mktemp("migrated") / "stage2.yaml"
    result = _cli("migrate", leaf, "-o", out, "--base-dir", root)
    assert result.exit_code == 2, result.output  # upstream-only features were left out: the user is told
    text = " ".join(result.output.split())
    for key in ("custom.augmentation", "training.save_delay_steps", "desc_monitor"):
        assert key in text, key
    assert "left out training.deepspeed" not in text  # upstream's ZeRO-2 with packing is kept
    return out


def test_the_migrated_chain_validates_and_shows_the_recipe(migrated):
    result = _cli("validate", migrated, "--print-contract", "--json")
    assert result.exit_code == 0, result.output
    contract = json.loads(result.stdout)[0]["contract"]
    tuner, training = contract["tuner"], contract["training"]
    assert (tuner["train_type"], tuner["use_dora"], tuner["lora_rank"], tuner["lora_alpha"]) == ("lora", True, 4, 8)
    assert (training["learning_rate"], training["vit_lr"], training["aligner_lr"]) == (LLM_LR, VIT_LR, ALIGNER_LR)
    assert training["lr_scheduler_type"] == "cosine_with_min_lr"
    assert contract["trainer_variant"] == "stage2_rollout_aligned"
    assert Path(contract["model"]["path"]).name == "Qwen3-VL-tiny-coordexp"  # launch-relative path kept its meaning
    assert contract["model"]["family"] == "qwen3_vl"  # read from the checkpoint: the config names no family


def test_the_migrated_config_trains_a_dora_adapter_with_three_rates_and_resumes(migrated):
    from coordexp.runtime.train.launch import build_trainer
    from coordexp.schema.contract import load_contract

    result = _cli("train", migrated, "--json")
    assert result.exit_code == 0, result.output
    summary = _json(result)
    assert summary["global_step"] == 2
    run_dir = Path(summary["output_dir"])
    adapter = json.loads((run_dir / "adapter_config.json").read_text(encoding="utf-8"))
    assert adapter["use_dora"] is True and adapter["r"] == 4
    assert (run_dir / "checkpoint-1" / "adapter_config.json").is_file()

    resumed = _cli("train", migrated, "--resume", run_dir / "checkpoint-1", "--json")
    assert resumed.exit_code == 0, resumed.output
    assert _json(resumed)["global_step"] == 2

    trainer = build_trainer(load_contract(migrated))
    optimizer = trainer.create_optimizer()
    rates = {}
    for group in optimizer.param_groups:
        rates.setdefault(group["part"], set()).add(group["lr"])
    # the coord rows of the embeddings and head train too (tuner.train_coord_rows), at learning_rate by default
    assert rates == {"llm": {LLM_LR}, "vision": {VIT_LR}, "aligner": {ALIGNER_LR}, "coord_embed": {LLM_LR},
                     "coord_head": {LLM_LR}}
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or ".trainable_tokens_delta." in n for n in trained)  # only the adapter
