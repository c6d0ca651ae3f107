"""``coordexp migrate`` maps upstream's coord-offset adapter (``custom.coord_offset``, ``optimizer:
multimodal_coord_offset``) onto ``tuner.train_coord_rows`` / ``coord_embed_lr`` / ``coord_head_lr`` /
``coord_weight_decay``: nothing of it is dropped silently and the result validates. The chains are hand-written
in the upstream's shape (its stage-1 DoRA leaf extends sft_base.yaml, which extends base.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordexp.schema.loader import validate_config_file
from coordexp.schema.migrate_chain import migrate_chain

BASE = {"global_max_length": 12000, "model": {"torch_dtype": "bfloat16", "attn_impl": "sdpa"},
        "template": {"template": "qwen3_vl"},
        "training": {"weight_decay": 0.1, "lr_scheduler_type": "cosine_warmup_with_min_lr",
                     "lr_scheduler_kwargs": {"min_lr": 1e-6}}}
SFT_BASE = {"extends": "../base.yaml", "model": {"model": "model_cache/Qwen3-VL-4B-Instruct-coordexp"},
            "tuner": {"train_type": "lora", "use_dora": True, "use_swift_lora": False, "freeze_llm": False,
                      "target_modules": ["all-linear"], "modules_to_save": [], "lora_rank": 16, "lora_alpha": 32},
            "training": {"optimizer": "multimodal", "learning_rate": 4e-4, "vit_lr": 2e-4, "aligner_lr": 8e-4},
            "custom": {"coord_soft_ce_w1": {"enabled": True, "soft_ce_weight": 1.0, "w1_weight": 1.0,
                                            "gate_weight": 1.0, "temperature": 1.0, "target_sigma": 2.0}}}
COORD_OFFSET = {"enabled": True, "tie_head": True, "ids": {"start": 151670, "end": 152669},
                "embed_lr": 1e-4, "head_lr": 1e-4, "weight_decay": 0.0}
STAGE1 = {"extends": "sft_base.yaml",
          "training": {"output_dir": "./output/stage_1", "optimizer": "multimodal_coord_offset",
                       "learning_rate": 2e-4, "vit_lr": 1e-4, "aligner_lr": 4e-4},
          "custom": {"train_jsonl": "public_data/train.coord.jsonl", "coord_offset": COORD_OFFSET}}


def _chain(root: Path, stage1: dict, sft_base: dict = SFT_BASE) -> Path:
    for rel, data in (("configs/base.yaml", BASE), ("configs/dlora/sft_base.yaml", sft_base),
                      ("configs/dlora/sft_stage1_softce_w1.yaml", stage1)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return root / "configs/dlora/sft_stage1_softce_w1.yaml"


def _migrate(root: Path, leaf: Path):
    out = root / "out.yaml"
    migration = migrate_chain(leaf, output=out, base_dir=root).files[0].migration
    assert validate_config_file(out).ok, validate_config_file(out).errors
    return migration, yaml.safe_load(out.read_text(encoding="utf-8"))


def test_the_upstream_stage1_leaf_keeps_its_coord_offset_and_optimizer(tmp_path):
    migration, written = _migrate(tmp_path, _chain(tmp_path, STAGE1))
    left = " | ".join(migration.left_out)
    assert "coord_offset" not in left and "optimizer" not in left, left
    assert {k: written["tuner"][k] for k in (
        "train_coord_rows", "coord_embed_lr", "coord_head_lr", "coord_weight_decay")} == {
        "train_coord_rows": True, "coord_embed_lr": 1e-4, "coord_head_lr": 1e-4, "coord_weight_decay": 0.0}
    assert "optimizer" not in written["training"] and "coord_offset" not in written.get("custom", {})
    changes = " | ".join(migration.changes)
    assert "multimodal_coord_offset" in changes and "custom.coord_offset.ids" in changes


LRS = st.one_of(st.none(), st.sampled_from([1e-5, 1e-4, 3e-4]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(enabled=st.booleans(), tie_head=st.sampled_from([None, True, False]), embed_lr=LRS, head_lr=LRS,
       weight_decay=st.one_of(st.none(), st.sampled_from([0.0, 0.05])),
       ids=st.sampled_from([None, {"start": 10, "end": 1009}, {"start": 10, "end": 509}, list(range(1000))]),
       dtype=st.booleans(), in_parent=st.booleans())
def test_every_coord_offset_key_is_mapped_or_left_out_by_name(tmp_path_factory, enabled, tie_head, embed_lr,
                                                              head_lr, weight_decay, ids, dtype, in_parent):
    root = tmp_path_factory.mktemp("chain")
    block = {"enabled": enabled}
    for key, value in (("tie_head", tie_head), ("embed_lr", embed_lr), ("head_lr", head_lr),
                       ("weight_decay", weight_decay), ("ids", ids)):
        if value is not None:
            block[key] = value
    if dtype:
        block["dtype"] = "bfloat16"
    stage1 = {**STAGE1, "custom": {"train_jsonl": "public_data/train.coord.jsonl"}}
    sft_base = {**SFT_BASE, "custom": {**SFT_BASE["custom"], "coord_offset": block}} if in_parent else SFT_BASE
    if not in_parent:
        stage1["custom"] = {**stage1["custom"], "coord_offset": block}
    migration, written = _migrate(root, _chain(root, stage1, sft_base))
    tuner, left = written["tuner"], migration.left_out
    assert not any(line.startswith("training.optimizer") for line in left)
    assert tuner["train_coord_rows"] is enabled
    if not enabled:
        assert not any("coord_offset" in line for line in left)
        assert all(tuner.get(k) is None for k in ("coord_embed_lr", "coord_head_lr", "coord_weight_decay"))
        return
    assert tuner.get("coord_embed_lr") == embed_lr
    assert tuner.get("coord_head_lr") == (head_lr if tie_head is False else embed_lr)
    assert tuner["coord_weight_decay"] == (0.0 if weight_decay is None else weight_decay)  # upstream's default
    assert any(line.startswith("custom.coord_offset.tie_head:") for line in left) is (tie_head is False)
    partial_ids = ids == {"start": 10, "end": 509}
    assert any(line.startswith("custom.coord_offset.ids:") for line in left) is partial_ids
    assert any(line.startswith("custom.coord_offset:") and "dtype" in line for line in left) is dtype


@pytest.mark.parametrize("tuner", [{"train_type": "full"}, {"freeze_llm": True, "freeze_aligner": False}])
def test_coord_offset_without_adapter_coord_rows_is_left_out_with_the_reason(tmp_path, tuner):
    sft_base = {**SFT_BASE, "tuner": {**SFT_BASE["tuner"], **tuner}}
    if tuner.get("train_type") == "full":
        sft_base["tuner"] = {k: v for k, v in sft_base["tuner"].items() if k not in ("use_dora", "modules_to_save")}
    migration, written = _migrate(tmp_path, _chain(tmp_path, STAGE1, sft_base))
    (line,) = [line for line in migration.left_out if line.startswith("custom.coord_offset:")]
    assert ("train_type: full" if "train_type" in tuner else "freeze_llm freezes") in line
    assert "(value was {'enabled': True" in line
    assert not {"coord_embed_lr", "coord_head_lr", "coord_weight_decay"} & set(written["tuner"])
