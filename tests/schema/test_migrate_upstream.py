"""``coordexp migrate`` on upstream-shaped extends chains (issue 20 item 5): one self-contained valid file from the
leaf, every file migrated with its backup in place, launch-relative paths kept, nothing dropped silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.schema.loader import validate_config_file
from coordexp.schema.migrate_chain import migrate_chain


runner = CliRunner()
REGEX = (r"^(model\.visual\.merger\.(linear_fc1|linear_fc2)|model\.visual\.deepstack_merger_list\.(0|1|2)\."
         r"(linear_fc1|linear_fc2)|model\.language_model\.layers\.(2[8-9]|3[0-5])\.(self_attn\.(q_proj|k_proj|v_proj|"
         r"o_proj)|mlp\.(gate_proj|up_proj|down_proj)))$")

BASE = {
    "global_max_length": 4096,
    "model": {"torch_dtype": "bfloat16", "attn_impl": "flash_attention_2"},
    "template": {"template": "qwen3_vl", "truncation_strategy": "right", "max_pixels": 1572864999},
    "data": {"dataset": ["dummy"], "val_dataset": ["dummy"], "dataloader_persistent_workers": True},
    "training": {"lr_scheduler_type": "cosine_warmup_with_min_lr", "max_grad_norm": 0.5, "gradient_checkpointing": True,
                 "bf16": True, "seed": 17, "report_to": ["tensorboard"], "save_last_epoch": True,
                 "metric_for_best_model": "eval_token_acc", "greater_is_better": True},
    "deepspeed": {"enabled": True, "config": "zero2"},
    "custom": {"json_format": "standard", "dump_conversation_text": False,
               "dump_conversation_path": "output/conversation_text.txt"},
}
SFT_BASE = {
    "extends": "../base.yaml",
    "model": {"model": "model_cache/Qwen3-VL-8B-Instruct-coordexp"},
    "tuner": {"train_type": "lora", "use_dora": True, "use_swift_lora": False, "freeze_llm": False,
              "freeze_vit": False, "freeze_aligner": False, "target_modules": ["all-linear"], "target_regex": None,
              "modules_to_save": [], "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.1, "lora_bias": "none"},
    "training": {"optimizer": "multimodal", "learning_rate": 4e-4, "vit_lr": 2e-4, "aligner_lr": 8e-4,
                 "weight_decay": 0.1, "lr_scheduler_kwargs": {"min_lr": 1e-6}, "warmup_ratio": 0.1,
                 "save_delay_steps": 1800, "add_version": True},
    "data": {"dataset_num_proc": 8, "dataloader_num_workers": 16},
    "custom": {"emit_norm": "none", "object_ordering": "sorted",
               "coord_tokens": {"enabled": True, "skip_bbox_norm": True},
               "coord_soft_ce_w1": {"enabled": True, "soft_ce_weight": 1.0, "w1_weight": 1.0, "gate_weight": 1.0,
                                    "temperature": 1.0, "target_sigma": 2.0, "target_truncate": 16},
               "augmentation": {"enabled": False, "bypass_prob": 0.1, "ops": [{"name": "hflip", "params": {"prob": 0.2}}]},
               "augmentation_curriculum": None},
}
STAGE1 = {
    "extends": "sft_base.yaml",
    "global_max_length": 12000,
    "model": {"model": "output/12-24/coord_loss-merged/ckpt-3106"},
    "custom": {"train_jsonl": "public_data/lvis/train.coord.jsonl", "val_jsonl": "public_data/lvis/val.coord.jsonl",
               "val_sample_limit": 1000, "token_type_metrics": {"enabled": True, "include": ["lvis"]}},
    "training": {"output_dir": "./output/1-15/stage1", "num_train_epochs": 4, "learning_rate": 2e-5,
                 "vit_lr": 2e-5, "aligner_lr": 5e-5, "effective_batch_size": 32,
                 "packing": True},
    "debug": {"enabled": True, "output_dir": "./output_debug/"},
}
ENGINE = {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.45, "max_model_len": 16000, "max_num_seqs": 4,
          "max_num_batched_tokens": 16384, "infer_batch_size": 1, "enforce_eager": True, "skip_mm_profiling": True,
          "mm_encoder_tp_mode": "weights", "limit_mm_per_prompt": {"image": 1, "video": 0},
          "enable_chunked_prefill": True, "disable_chunked_mm_input": True, "enable_lora": False,
          "enable_prefix_caching": True, "sleep_level": 0}
COLOCATE = {
    "extends": "sft_base.yaml",
    "global_max_length": 16000,
    "model": {"model": "output/12-24/coord_loss-merged/ckpt-3106"},
    "tuner": {"train_type": "lora", "use_dora": True, "freeze_vit": True, "target_regex": REGEX},
    "custom": {"trainer_variant": "rollout_matching_sft", "train_jsonl": "public_data/lvis/train.coord.jsonl",
               "train_sample_limit": 128, "val_sample_limit": 32,
               "extra": {"rollout_matching": {
                   "rollout_backend": "vllm", "rollout_generate_batch_size": 2, "post_rollout_pack_scope": "window",
                   "rollout_buffer": {"enabled": True, "m_steps": 4}, "decode_mode": "greedy", "max_new_tokens": 8192,
                   "temperature": 0.0, "repetition_penalty": 1.05, "candidate_top_k": 5, "fp_cost": 1, "fn_cost": 2,
                   "ot_cost": "l2", "ot_epsilon": 10, "ot_iters": 3,
                   "desc_monitor": {"enabled": True, "mode": "exact"}, "vllm": ENGINE}}},
    "training": {"output_dir": "output/stage2_colocate", "learning_rate": 2e-5, "vit_lr": 2e-5, "aligner_lr": 5e-5,
                 "effective_batch_size": 32, "save_delay_steps": 200, "packing": True},
}
SERVER = {
    "inherit": "stage2_colocate.yaml",
    "custom": {"extra": {"rollout_matching": {"vllm": {
        "mode": "server", "sync": {"mode": "full", "fallback_to_full": True},
        "server": {"servers": [{"base_url": "http://127.0.0.1:8000", "group_port": 51216}], "timeout_s": 240.0}}}}},
    "training": {"output_dir": "output/stage2_server_3v1"},
}


def _tree(root: Path) -> dict[str, Path]:
    """The upstream-shaped repo: configs/ with three chains, launched from ``root`` (the repo root)."""
    files = {"base": ("configs/base.yaml", BASE), "sft_base": ("configs/dlora/sft_base.yaml", SFT_BASE),
             "stage1": ("configs/dlora/sft_stage1.yaml", STAGE1),
             "colocate": ("configs/dlora/stage2_colocate.yaml", COLOCATE),
             "server": ("configs/dlora/stage2_server.yaml", SERVER)}
    paths = {}
    for name, (rel, data) in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        paths[name] = path
    return paths


def _run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def _contract(out: Path) -> dict:
    result = _run("validate", str(out), "--print-contract", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)[0]["contract"]


def test_a_stage1_dora_chain_becomes_one_valid_file_with_the_recipe(tmp_path):
    paths = _tree(tmp_path)
    out = tmp_path / "s1.yaml"
    result = _run("migrate", str(paths["stage1"]), "-o", str(out), "--base-dir", str(tmp_path))
    assert result.exit_code == 2, result.output  # features were left out: the user decides
    for key in ("custom.augmentation", "custom.augmentation_curriculum", "debug",
                "training.save_delay_steps", "training.add_version", "data.dataset_num_proc"):
        assert f"left out {key}:" in result.output
    written = yaml.safe_load(out.read_text())
    assert "extends" not in written and "qwen3_vl" not in out.read_text()  # the family comes from the checkpoint
    contract = _contract(out)
    tuner, training = contract["tuner"], contract["training"]
    assert (tuner["train_type"], tuner["use_dora"], tuner["lora_rank"], tuner["lora_alpha"]) == ("lora", True, 16, 32)
    assert (training["learning_rate"], training["vit_lr"], training["aligner_lr"]) == (2e-5, 2e-5, 5e-5)
    # upstream ran ZeRO-2 with packing, and so does the migrated run
    assert "left out training.deepspeed" not in " ".join(result.output.split())
    assert training["report_to"] == ["tensorboard"] and training["deepspeed"] == "zero2" and training["packing"]
    # upstream's own eval metric is coordexp's teacher-forced token accuracy: kept with its direction
    text = " ".join(result.output.split())
    assert "left out training.metric_for_best_model" not in text and "left out training.greater_is_better" not in text
    assert training["metric_for_best_model"] == "eval_token_acc" and training["greater_is_better"] is True
    assert training["token_type_metrics"] is True and contract["data"]["object_order"] == "sorted"
    assert training["lr_scheduler_type"] == "cosine_with_min_lr" and training["effective_batch_size"] == 32
    assert contract["trainer_variant"] == "stage1_sft" and contract["model"]["gradient_checkpointing"] is True
    assert contract["data"]["max_val_samples"] == 1000


def test_a_server_leaf_inheriting_a_colocate_leaf_keeps_every_rollout_knob(tmp_path):
    paths = _tree(tmp_path)
    out = tmp_path / "out" / "s2.yaml"
    out.parent.mkdir()
    result = _run("migrate", str(paths["server"]), "-o", str(out), "--base-dir", str(tmp_path))
    assert result.exit_code == 2 and "left out rollout_matching.desc_monitor:" in result.output
    contract = _contract(out)
    rm = contract["rollout_matching"]
    assert contract["trainer_variant"] == "stage2_rollout_aligned"
    assert contract["tuner"]["target_regex"] == REGEX and contract["tuner"]["freeze_vit"] is True
    assert rm["backend"]["kind"] == "vllm_server" and rm["backend"]["servers"][0]["group_port"] == 51216
    engine = rm["serving"]["engine"]
    assert {k: engine[k] for k in ENGINE if k in engine} == {k: v for k, v in ENGINE.items() if k in engine}
    assert set(ENGINE) - {"mode"} <= set(engine)
    assert rm["decoding"]["num_beams"] == 1 and rm["decoding"]["repetition_penalty"] == 1.05
    assert rm["decode_batch_size"] == 2 and rm["matching"]["fp_cost"] == 1 and rm["matching"]["fn_cost"] == 2
    assert rm["ot"]["iters"] == 3 and rm["max_new_tokens"] == 8192
    coord = next(m for m in rm["pipeline"]["objective"] if m["name"] == "coord_reg")  # from the PARENT's keys
    assert coord["config"]["target_truncate"] == 16
    assert contract["training"]["deepspeed"] == "zero2"  # from base.yaml, kept next to packing


def test_relative_paths_keep_their_upstream_meaning_relative_to_the_launch_directory(tmp_path):
    paths = _tree(tmp_path)
    (tmp_path / "public_data" / "lvis").mkdir(parents=True)
    out = tmp_path / "s1.yaml"
    result = _run("migrate", str(paths["stage1"]), "-o", str(out), "--base-dir", str(tmp_path))
    assert "data.train_jsonl: 'public_data/lvis/train.coord.jsonl' resolved against --base-dir" in result.output
    written = yaml.safe_load(out.read_text())
    assert written["data"]["train_jsonl"] == "./public_data/lvis/train.coord.jsonl"  # OUT-relative
    assert written["model"]["path"] == "./output/12-24/coord_loss-merged/ckpt-3106"  # a path, not a hub id
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    far = elsewhere / "s1.yaml"
    _run("migrate", str(paths["stage1"]), "-o", str(far), "--base-dir", str(tmp_path / "configs"))
    assert yaml.safe_load(far.read_text())["data"]["train_jsonl"] == str(
        tmp_path / "configs" / "public_data/lvis/train.coord.jsonl")  # outside OUT's folder: absolute


def test_in_place_migrates_every_chain_file_with_a_byte_identical_backup(tmp_path):
    paths = _tree(tmp_path)
    chain = [paths["base"], paths["sft_base"], paths["colocate"], paths["server"]]
    before = {p: p.read_bytes() for p in chain}
    result = _run("migrate", str(paths["server"]), "--in-place", "--base-dir", str(tmp_path))
    assert result.exit_code == 2, result.output  # left-out features, yet the leaf validates
    assert "validates" in result.output
    for path in chain:
        assert path.with_name(path.name + ".bak").read_bytes() == before[path]
        assert path.read_bytes() != before[path]
    assert yaml.safe_load(paths["server"].read_text())["extends"] == "stage2_colocate.yaml"  # inherit -> extends
    assert validate_config_file(paths["server"]).ok
    colocate = yaml.safe_load(paths["colocate"].read_text())
    assert colocate["data"]["train_jsonl"] == "../../public_data/lvis/train.coord.jsonl"  # file-relative now


def test_validate_names_the_leaf_to_migrate_for_a_legacy_key_in_a_parent(tmp_path):
    paths = _tree(tmp_path)
    report = validate_config_file(paths["stage1"])
    parent = [i for i in report.errors if i.path == "template.template"]
    assert parent and "sft_stage1.yaml -o NEW.yaml" in parent[0].hint and "base.yaml" in parent[0].file


def test_a_chain_without_upstream_features_migrates_with_exit_0(tmp_path):
    paths = _tree(tmp_path)
    leaf = tmp_path / "configs" / "clean.yaml"
    leaf.write_text(yaml.safe_dump({"inherit": "dlora/stage2_colocate.yaml"}))
    out = tmp_path / "clean_out.yaml"
    migrate_chain(leaf, output=out, base_dir=tmp_path)
    assert validate_config_file(out).ok
    assert paths  # the chain's own left-outs are reported; a clean leaf adds none


UPSTREAM_ONLY = {
    "custom.augmentation": {"enabled": True}, "custom.desc_monitor_x": 1, "custom.log_file": {"enabled": True},
    "custom.coord_offset": {"enabled": True, "dtype": "float32"}, "custom.visual_kd": {"vit": {"enabled": True}},
    "training.save_last_epoch": False, "training.save_delay_epochs": 1, "data.dataset_num_proc": 2,
    "custom.extra.instability_monitor": {"enabled": True}, "debug": {"enabled": False}, "rlhf": {"beta": 0.1},
    "training.not_a_field_anywhere": 3,
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=st.sets(st.sampled_from(sorted(UPSTREAM_ONLY)), min_size=1), in_parent=st.booleans())
def test_no_upstream_key_is_dropped_silently(tmp_path_factory, keys, in_parent):
    """Wherever an upstream-only key sits in the chain, it is listed as left out by name, and the result validates."""
    root = tmp_path_factory.mktemp("chain")
    paths = _tree(root)
    target = paths["sft_base"] if in_parent else paths["stage1"]
    data = yaml.safe_load(target.read_text())
    for dotted in keys:
        node = data
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = UPSTREAM_ONLY[dotted]
    target.write_text(yaml.safe_dump(data))
    out = root / "out.yaml"
    result = migrate_chain(paths["stage1"], output=out, base_dir=root)
    left = result.files[0].migration.left_out
    assert all(any(line.startswith(f"{k}:") for line in left) for k in keys), (keys, left)
    assert result.needs_user and validate_config_file(out).ok


STAGE2_AB_BASE = {
    "extends": "../base.yaml",
    "model": {"model": "output/1-26/checkpoint-1516-merged"},
    "tuner": {"train_type": "lora", "use_dora": True, "use_swift_lora": False, "target_modules": ["all-linear"],
              "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.0},
    "training": {"per_device_train_batch_size": 1, "effective_batch_size": 64, "packing": True, "optimizer": "multimodal",
                 "learning_rate": 2e-5, "vit_lr": 2e-5, "aligner_lr": 5e-5, "weight_decay": 0.0,
                 "lr_scheduler_kwargs": {"min_lr": 1e-6}},
    "data": {"dataloader_num_workers": 4},
    "stage2_ab": {"schedule": {"b_ratio": 0.05}, "n_softctx_iter": 2, "bbox_smoothl1_weight": 2.0, "channel_b": {}},
    "custom": {"trainer_variant": "stage2_ab_training", "train_jsonl": "public_data/lvis/train.coord.jsonl",
               "val_jsonl": "public_data/lvis/val.coord.jsonl", "coord_soft_ce_w1": {"enabled": True}},
    "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 4, "decode_mode": "greedy",
                         "max_new_tokens": 3084, "candidate_top_k": 5, "maskiou_gate": 0.3, "fp_cost": 0.5,
                         "fn_cost": 2, "ot_cost": "l2", "ot_epsilon": 10, "ot_iters": 1},
}


@pytest.mark.parametrize(("b_ratio", "share"), [(0.85, 0.15), (1.0, 0.0), (0.0, 1.0)])
def test_a_stage2_ab_leaf_trains_rollouts_with_its_ground_truth_steps(tmp_path, b_ratio, share):
    """Upstream's stage2_ab_training (channel B rollouts on b_ratio of the steps, channel A ground truth on the rest)
    migrates to stage 2 with rollout_matching.gt_step_share = 1 - b_ratio; before, its trainer variant was refused."""
    _tree(tmp_path)
    base = tmp_path / "configs" / "stage2_ab" / "base.yaml"
    leaf = tmp_path / "configs" / "stage2_ab" / "prod" / "ab_mixed.yaml"
    leaf.parent.mkdir(parents=True)
    base.write_text(yaml.safe_dump(STAGE2_AB_BASE, sort_keys=False))
    leaf.write_text(yaml.safe_dump({"extends": "../base.yaml", "stage2_ab": {"schedule": {"b_ratio": b_ratio}},
                                    "training": {"output_dir": "output/stage2_ab/prod/ab_mixed"}}, sort_keys=False))
    out = tmp_path / "ab.yaml"
    result = _run("migrate", str(leaf), "-o", str(out), "--base-dir", str(tmp_path))
    assert result.exit_code == 2, result.output  # channel A's soft context and box loss are left out, said
    text = " ".join(result.output.split())
    for key in ("stage2_ab.n_softctx_iter", "stage2_ab.bbox_smoothl1_weight", "stage2_ab.channel_b"):
        assert f"left out {key}:" in text
    assert "stage2_ab.schedule" not in yaml.safe_load(out.read_text()).get("stage2_ab", {})
    contract = _contract(out)
    assert contract["trainer_variant"] == "stage2_rollout_aligned"
    rollout = contract["rollout_matching"]
    assert rollout["gt_step_share"] == pytest.approx(share)
    assert [m["name"] for m in rollout["pipeline"]["objective"]] == ["token_ce", "coord_reg"]
