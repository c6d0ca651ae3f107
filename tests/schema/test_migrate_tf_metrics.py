"""``coordexp migrate`` maps upstream's evaluation metric and monitors (issue 28 items 3, 4): ``metric_for_best_model:
eval_token_acc`` with its ``greater_is_better``, ``custom.token_type_metrics`` and ``custom.object_ordering`` land on
coordexp keys (none is left out), and the migrated file validates with them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.schema.loader import validate_config_file
from coordexp.schema.migrate_chain import migrate_chain

runner = CliRunner()
WATCHED = ("metric_for_best_model", "greater_is_better", "object_ordering", "token_type_metrics")

# the shapes of upstream's configs/base.yaml -> configs/dlora/sft_base.yaml -> a stage-1 leaf, hand-written
BASE = {
    "global_max_length": 4096,
    "model": {"torch_dtype": "bfloat16", "attn_impl": "sdpa"},
    "template": {"template": "qwen3_vl"},
    "training": {"seed": 17, "eval_strategy": "steps", "eval_steps": 20, "metric_for_best_model": "eval_token_acc",
                 "greater_is_better": True},
    "custom": {"json_format": "standard", "emit_norm": "none"},
}
SFT_BASE = {"extends": "../base.yaml", "model": {"model": "model_cache/Qwen3-VL-4B-Instruct-coordexp"},
            "custom": {"object_ordering": "sorted",
                       "coord_soft_ce_w1": {"enabled": True, "soft_ce_weight": 1.0, "w1_weight": 1.0, "gate_weight": 1.0,
                                            "temperature": 1.0, "target_sigma": 2.0, "target_truncate": 16}}}
LEAF = {
    "extends": "sft_base.yaml",
    "training": {"output_dir": "./output/stage_1", "learning_rate": 2e-4},
    "custom": {"train_jsonl": "public_data/train.jsonl", "val_jsonl": "public_data/val.jsonl",
               "token_type_metrics": {"enabled": True}},
}


def _chain(root: Path, base=BASE, sft_base=SFT_BASE, leaf=LEAF) -> Path:
    for rel, data in (("configs/base.yaml", base), ("configs/dlora/sft_base.yaml", sft_base),
                      ("configs/dlora/leaf.yaml", leaf)):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return root / "configs/dlora/leaf.yaml"


def _migrated(tmp_path: Path, **files) -> tuple[dict, list[str], list[str]]:
    """(migrated mapping, changes, left-out lines) of the flattened chain."""
    result = migrate_chain(_chain(tmp_path, **files), output=tmp_path / "out.yaml", base_dir=tmp_path)
    migration = result.files[0].migration
    return yaml.safe_load((tmp_path / "out.yaml").read_text()), migration.changes, migration.left_out


def test_the_upstream_stage1_chain_keeps_its_metric_and_monitors(tmp_path):
    leaf = _chain(tmp_path)
    out = tmp_path / "s1.yaml"
    result = runner.invoke(app, ["migrate", str(leaf), "-o", str(out), "--base-dir", str(tmp_path)],
                           catch_exceptions=False)
    text = " ".join(result.output.split())
    for key in WATCHED:
        assert f"left out training.{key}" not in text and f"left out custom.{key}" not in text, key
    contract = json.loads(runner.invoke(app, ["validate", str(out), "--print-contract", "--json"]).stdout)[0]
    training = contract["contract"]["training"]
    assert (training["metric_for_best_model"], training["greater_is_better"]) == ("eval_token_acc", True)
    assert training["token_type_metrics"] is True
    assert contract["contract"]["data"]["object_order"] == "sorted"


@pytest.mark.parametrize(("written", "expected"), [("sorted", "sorted"), ("random", "random"), ("Random", "random")])
def test_object_ordering_maps_onto_data_object_order(tmp_path, written, expected):
    sft = copy.deepcopy(SFT_BASE)
    sft["custom"]["object_ordering"] = written
    data, changes, left_out = _migrated(tmp_path, sft_base=sft)
    assert data["data"]["object_order"] == expected and "object_ordering" not in data.get("custom", {})
    assert any("custom.object_ordering" in c and "data.object_order" in c for c in changes)
    assert not any("object_ordering" in line for line in left_out)


def test_an_object_ordering_upstream_refused_is_left_out_naming_the_new_key(tmp_path):
    sft = copy.deepcopy(SFT_BASE)
    sft["custom"]["object_ordering"] = "diagonal"
    data, _, left_out = _migrated(tmp_path, sft_base=sft)
    (line,) = [line for line in left_out if line.startswith("custom.object_ordering")]
    assert "data.object_order" in line and "'diagonal'" in line and "object_order" not in data.get("data", {})


@pytest.mark.parametrize("enabled", [True, False])
def test_token_type_metrics_maps_its_switch_and_drops_the_dataset_filters(tmp_path, enabled):
    leaf = copy.deepcopy(LEAF)
    leaf["custom"]["token_type_metrics"] = {"enabled": enabled, "include": ["lvis"], "exclude": []}
    data, changes, left_out = _migrated(tmp_path, leaf=leaf)
    assert data["training"]["token_type_metrics"] is enabled and "token_type_metrics" not in data.get("custom", {})
    assert any("custom.token_type_metrics.include" in c and "one dataset" in c for c in changes)
    assert not any("token_type_metrics" in line for line in left_out)


def test_token_type_monitors_coordexp_lacks_are_left_out_one_by_one(tmp_path):
    leaf = copy.deepcopy(LEAF)
    leaf["custom"]["token_type_metrics"] = {"enabled": True, "log_top5": True, "coord_monitor_mass": False}
    data, _, left_out = _migrated(tmp_path, leaf=leaf)
    assert data["training"]["token_type_metrics"] is True
    assert sorted(line.split(":")[0] for line in left_out if "token_type_metrics" in line) == [
        "custom.token_type_metrics.coord_monitor_mass", "custom.token_type_metrics.log_top5"]


def test_an_upstream_metric_coordexp_does_not_report_is_still_left_out_with_its_direction(tmp_path):
    base = copy.deepcopy(BASE)
    base["training"]["metric_for_best_model"] = "rollout/f1"
    data, _, left_out = _migrated(tmp_path, base=base)
    assert any(line.startswith("training.metric_for_best_model") and "token_acc" in line for line in left_out)
    assert any(line.startswith("training.greater_is_better") for line in left_out)
    assert "metric_for_best_model" not in data["training"]


def test_in_place_moves_each_file_s_own_keys_and_the_leaf_validates(tmp_path):
    leaf = _chain(tmp_path)
    (tmp_path / "public_data").mkdir()
    result = migrate_chain(leaf, in_place=True, base_dir=tmp_path)
    assert not any(key in line for f in result.files for line in f.migration.left_out for key in WATCHED)
    sft = yaml.safe_load((tmp_path / "configs/dlora/sft_base.yaml").read_text())
    assert sft["data"]["object_order"] == "sorted"
    assert yaml.safe_load(leaf.read_text())["training"]["token_type_metrics"] is True
    assert validate_config_file(leaf).ok
