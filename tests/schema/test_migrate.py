"""``migrate``: every legacy example becomes valid canonical YAML, idempotently; unmovable keys are reported."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from coordexp.schema.legacy import LEGACY_KEYS, find_legacy_keys
from coordexp.schema.loader import validate_config_file, validate_mapping
from coordexp.schema.migrate import OLD_COORD_DEFAULTS, migrate_mapping, migrate_text
from coordexp.schema.yaml_io import parse_yaml_text

REPO = Path(__file__).resolve().parents[2]


def _place(data: dict, pattern: str, value) -> str:
    """Put ``value`` at a concrete instance of ``pattern`` (``[*]`` -> the module entry, ``*`` -> a name)."""
    index = 2 if "bbox_" in pattern else 1  # bbox_geo is objective[2], coord_reg objective[1]
    concrete = pattern.replace("[*]", f"[{index}]").replace(".*", ".zz_any")
    node = data
    tokens = re.findall(r"[^.\[\]]+|\[\d+\]", concrete)
    for token in tokens[:-1]:
        node = node[int(token[1:-1])] if token.startswith("[") else node.setdefault(token, {})
    node[tokens[-1]] = value
    return concrete
LEGACY_EXAMPLES = sorted((REPO / "examples" / "legacy").glob("*.yaml"))


def test_there_are_legacy_examples_and_they_fail_before_migration():
    assert len(LEGACY_EXAMPLES) >= 3
    for path in LEGACY_EXAMPLES:
        report = validate_config_file(path)
        assert not report.ok and any(i.message.startswith("legacy key") for i in report.errors)


@pytest.mark.parametrize("path", LEGACY_EXAMPLES, ids=lambda p: p.name)
def test_legacy_example_migrates_to_a_valid_config_and_round_trips(path, tmp_path):
    out = path.with_name(f".{path.stem}.migrated-test.yaml")  # same directory: relative paths keep working
    try:
        text, migration = migrate_text(path.read_text(), path, out)
        assert migration.changed and migration.unresolved == []
        out.write_text(text)
        report = validate_config_file(out)
        assert report.ok, [i.render() for i in report.errors]
        again, second = migrate_text(text, out, out)
        assert again == text and not second.changed and second.unresolved == []
    finally:
        out.unlink(missing_ok=True)


def test_old_server_example_content():
    path = REPO / "examples" / "legacy" / "old_custom_extra_server.yaml"
    text, _ = migrate_text(path.read_text(), path, path)
    data = parse_yaml_text(text)
    rm = data["rollout_matching"]
    assert rm["vllm"]["server"]["servers"] == [
        {"base_url": "http://10.0.0.5:8000", "group_port": 51216},
        {"base_url": "http://10.0.0.6:8000", "group_port": 51217},
        {"base_url": "http://10.0.0.7:8000", "group_port": 51218},
    ]
    assert rm["decoding"] == {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
    assert rm["decode_batch_size"] == 4
    coord = rm["pipeline"]["objective"][1]["config"]
    assert coord == {**OLD_COORD_DEFAULTS, "w1_weight": 0.5, "target_sigma": 2.0, "temperature": 1.0,
                     "target_truncate": 8.0}
    assert data["custom"] == {"trainer_variant": "stage2_rollout_aligned"}
    assert "packing_length" not in data["training"] and "rollout_buffer" not in rm


def _base(stage2_config) -> dict:
    data = copy.deepcopy(stage2_config)
    data["rollout_matching"]["vllm"] = {"mode": "server"}
    return data


def test_paired_lists_pair_by_index(stage2_config):
    data = _base(stage2_config)
    data["rollout_matching"]["vllm"]["server"] = {"base_url": ["http://a:1", "http://b:1"], "group_port": [7, 9]}
    m = migrate_mapping(data)
    assert m.data["rollout_matching"]["vllm"]["server"] == {
        "servers": [{"base_url": "http://a:1", "group_port": 7}, {"base_url": "http://b:1", "group_port": 9}]}
    assert validate_mapping(m.data).ok


@pytest.mark.parametrize(("urls", "ports"), [(["http://a:1", "http://b:1"], [7]), ("http://a:1", [7, 8])])
def test_unpairable_server_lists_are_left_and_reported(stage2_config, urls, ports):
    data = _base(stage2_config)
    data["rollout_matching"]["vllm"]["server"] = {"base_url": urls, "group_port": ports}
    m = migrate_mapping(data)
    assert m.data["rollout_matching"]["vllm"]["server"]["base_url"] == urls
    assert len(m.unresolved) == 1 and "cannot pair" in m.unresolved[0]


def test_conflicting_values_are_not_overwritten(stage2_config):
    stage2_config["rollout_matching"]["decode_batch_size"] = 2
    stage2_config["rollout_matching"]["rollout_infer_batch_size"] = 4
    m = migrate_mapping(stage2_config)
    assert m.data["rollout_matching"]["decode_batch_size"] == 2
    assert m.data["rollout_matching"]["rollout_infer_batch_size"] == 4
    assert any("already set to 2" in u for u in m.unresolved)
    stage2_config["rollout_matching"]["rollout_infer_batch_size"] = 2  # same value: a clean move
    m = migrate_mapping(stage2_config)
    assert "rollout_infer_batch_size" not in m.data["rollout_matching"] and m.unresolved == []


def test_beam_mode_without_width_needs_a_decision(stage2_config):
    stage2_config["rollout_matching"]["decode_mode"] = "beam"
    m = migrate_mapping(stage2_config)
    assert m.data["rollout_matching"]["decode_mode"] == "beam"
    assert any("set decoding.num_beams yourself" in u for u in m.unresolved)
    stage2_config["rollout_matching"]["decode_mode"] = "greedy"
    m = migrate_mapping(stage2_config)
    assert m.data["rollout_matching"]["decoding"] == {"num_beams": 1} and m.unresolved == []


def test_coord_overrides_go_into_the_existing_coord_reg_entry(stage2_config):
    stage2_config["rollout_matching"]["pipeline"]["objective"][1]["config"].pop("target_sigma")
    stage2_config["rollout_matching"]["target_sigma"] = 1.5
    m = migrate_mapping(stage2_config)
    assert m.data["rollout_matching"]["pipeline"]["objective"][1]["config"]["target_sigma"] == 1.5
    assert "target_sigma" not in m.data["rollout_matching"] and validate_mapping(m.data).ok


def test_packing_length_that_differs_is_explained(stage2_config):
    stage2_config["training"]["packing_length"] = 4096
    m = migrate_mapping(stage2_config)
    assert "packing_length" not in m.data["training"]
    assert any("Set global_max_length: 4096 if that was intended" in c for c in m.changes)


def test_canonical_file_is_left_byte_identical(stage2_config, write_yaml):
    path = write_yaml("# my comment\n" + write_yaml(stage2_config).read_text())
    text = path.read_text()
    again, m = migrate_text(text, path)
    assert again == text and not m.changed


def test_extends_is_rewritten_for_another_output_directory(write_yaml, tmp_path):
    write_yaml({"v": 1}, "conf/base.yaml")
    src = write_yaml({"extends": "base.yaml", "training": {"packing_length": 5}}, "conf/old.yaml")
    text, _ = migrate_text(src.read_text(), src, tmp_path / "out" / "new.yaml")
    assert parse_yaml_text(text)["extends"] == "../conf/base.yaml"


def test_nothing_legacy_survives_a_full_migration(stage2_config):
    rm = stage2_config["rollout_matching"]
    rm.update({"temperature": 0.7, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1, "num_return_sequences": 1,
               "rollout_generate_batch_size": 3, "channel_b_decode_batch_size": 3, "eval_decode_batch_size": 8,
               "post_rollout_pack_scope": "window", "coord_decode_mode": "st", "rollout_buffer": {"m_steps": 2},
               "candidate_top_k": 3, "ot_iters": 5, "temperature_coord": 1.0, "w1_weight": 1.0})
    stage2_config["training"].update({"eval_packing": True, "packing_avg_samples": 3})
    m = migrate_mapping(stage2_config)
    assert m.unresolved == [] and find_legacy_keys(m.data) == []
    assert validate_mapping(m.data).ok
    assert m.data["rollout_matching"]["decoding"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 50,
                                                      "repetition_penalty": 1.1}


_SAMPLE_VALUES = {"rollout_matching.decode_mode": "greedy", "custom.trainer_variant": "rollout_matching_sft",
                  "custom.coord_soft_ce_w1": None, "rollout_matching.ot_cost": "l1",
                  "rollout_matching.maskiou_resolution": 64, "model.freeze_vision_tower": False,
                  "model.model": "Qwen/Qwen2.5-VL-3B-Instruct", "model.torch_dtype": "float32", "model.attn_impl": "sdpa",
                  "custom.train_jsonl": "data/train.jsonl", "custom.val_jsonl": "v.jsonl", "template.template": "qwen2_vl",
                  "deepspeed": {"enabled": False}, "custom.object_ordering": "random",
                  "custom.token_type_metrics": {"enabled": True}}


@pytest.mark.parametrize("entry", [e for e in LEGACY_KEYS if e.migrates and ".vllm.server." not in e.pattern],
                         ids=lambda e: e.pattern)
def test_every_migratable_legacy_key_is_rewritten(stage2_config, entry):
    """The table's ``migrates`` flag is true: migrate leaves no legacy key and the result validates."""
    if entry.replacement and ".pipeline.objective[" in entry.replacement:  # leave the target key free
        index = 2 if "bbox_" in entry.pattern else 1
        config = stage2_config["rollout_matching"]["pipeline"]["objective"][index]["config"]
        config.pop(entry.replacement.rsplit(".", 1)[-1], None)
    path = _place(stage2_config, entry.pattern, _SAMPLE_VALUES.get(entry.pattern, 1))
    m = migrate_mapping(stage2_config)
    assert find_legacy_keys(m.data) == [] and m.unresolved == [], (path, m.unresolved)
    assert validate_mapping(m.data).ok, [i.render() for i in validate_mapping(m.data).errors]
