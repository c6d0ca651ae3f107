"""Every legacy key fails with its replacement and guidance, before (and instead of) "unknown key"."""

from __future__ import annotations

import re

import pytest

from coordexp.schema.legacy import LEGACY_KEYS, LEGACY_PREFIXES, _ANY, find_legacy_keys
from coordexp.schema.loader import validate_config_file, validate_mapping


def _place(data: dict, pattern: str, value) -> str:
    """Put ``value`` at a concrete instance of ``pattern`` inside ``data``; returns the concrete dotted path."""
    section = "diagnostics" if ".diagnostics[" in pattern else "objective"
    index = 0 if section == "diagnostics" else 1
    concrete = pattern.replace("[*]", f"[{index}]").replace(".*", ".zz_any")
    node = data
    tokens = re.findall(r"[^.\[\]]+|\[\d+\]", concrete)
    for token in tokens[:-1]:
        node = node[int(token[1:-1])] if token.startswith("[") else node.setdefault(token, {})
    node[tokens[-1]] = value
    return concrete


@pytest.mark.parametrize("entry", LEGACY_KEYS, ids=lambda e: e.pattern)
def test_every_legacy_key_fails_with_its_replacement(stage2_config, entry):
    value = entry.value if entry.value is not _ANY else 1
    concrete = _place(stage2_config, entry.pattern, value)
    report = validate_mapping(stage2_config)
    issues = {i.path: i for i in report.errors}
    assert list(issues) == [concrete], [i.render() for i in report.errors]
    issue = issues[concrete]
    if entry.replacement is None:
        assert issue.message == "legacy key, removed"
    else:
        expected = entry.replacement.format(*(["1"] if "{0}" in entry.replacement else []))
        assert issue.message == f"legacy key, replaced by {expected}"
    assert issue.hint.startswith(entry.guidance)


@pytest.mark.parametrize(
    ("sub_key", "replacement"),
    [
        ("decode_batch_size", "rollout_matching.decode_batch_size"),
        ("rollout_backend", "rollout_matching.rollout_backend"),
        ("repeat_terminate", "rollout_matching.repeat_terminate"),
        ("decoding", "rollout_matching.decoding"),
        ("temperature", "rollout_matching.decoding.temperature"),
        ("top_p", "rollout_matching.decoding.top_p"),
        ("top_k", "rollout_matching.decoding.top_k"),
        ("rollout_buffer", None),
        ("rollout_generate_batch_size", "rollout_matching.decode_batch_size"),
    ],
)
def test_custom_extra_rollout_matching_names_the_new_path(stage2_config, sub_key, replacement):
    stage2_config["custom"]["extra"] = {"rollout_matching": {sub_key: 1}}
    report = validate_mapping(stage2_config)
    assert [i.path for i in report.errors] == [f"custom.extra.rollout_matching.{sub_key}"]
    message = report.errors[0].message
    assert message == ("legacy key, removed" if replacement is None else f"legacy key, replaced by {replacement}")


def test_nested_legacy_keys_under_the_old_namespace_are_reported_too(stage2_config):
    stage2_config["custom"]["extra"] = {
        "rollout_matching": {"vllm": {"server": {"base_url": "http://a:1", "group_port": 5}}}
    }
    report = validate_mapping(stage2_config)
    paths = [i.path for i in report.errors]
    assert paths == [
        "custom.extra.rollout_matching.vllm",
        "custom.extra.rollout_matching.vllm.server.base_url",
        "custom.extra.rollout_matching.vllm.server.group_port",
    ]
    assert report.errors[1].message == "legacy key, replaced by rollout_matching.vllm.server.servers[]"


def test_empty_old_namespace_is_still_legacy(stage2_config):
    stage2_config["custom"]["extra"] = {"rollout_matching": None}
    report = validate_mapping(stage2_config)
    assert [(i.path, i.message) for i in report.errors] == [
        ("custom.extra.rollout_matching", "legacy key, replaced by rollout_matching")
    ]


def test_other_custom_extra_keys_are_unknown(stage2_config):
    stage2_config["custom"]["extra"] = {"rollout_matching": {"decode_batch_size": 2}, "foo": 1}
    report = validate_mapping(stage2_config)
    assert [(i.path, i.message) for i in report.errors] == [
        (
            "custom.extra.rollout_matching.decode_batch_size",
            "legacy key, replaced by rollout_matching.decode_batch_size",
        ),
        ("custom.extra", "unknown key"),
    ]


def test_paired_server_form_fails_without_a_missing_servers_error(stage2_config):
    stage2_config["rollout_matching"]["vllm"] = {
        "mode": "server",
        "server": {"base_url": ["http://a:1", "http://b:1"], "group_port": 51216},
    }
    report = validate_mapping(stage2_config)
    assert [i.path for i in report.errors] == [
        "rollout_matching.vllm.server.base_url",
        "rollout_matching.vllm.server.group_port",
    ]
    assert all("servers: [{base_url, group_port}" in i.hint for i in report.errors)


def test_alias_does_not_also_report_the_missing_canonical_key(stage2_config):
    config = stage2_config["rollout_matching"]["pipeline"]["objective"][2]["config"]
    config["bbox_smoothl1_weight"] = config.pop("smoothl1_weight")
    report = validate_mapping(stage2_config)
    assert [(i.path, i.message) for i in report.errors] == [
        (
            "rollout_matching.pipeline.objective[2].config.bbox_smoothl1_weight",
            "legacy key, replaced by rollout_matching.pipeline.objective[2].config.smoothl1_weight",
        )
    ]
    assert "rename bbox_smoothl1_weight to smoothl1_weight" in report.errors[0].hint


def test_old_trainer_variant_and_coord_soft_ce_w1(stage2_config):
    stage2_config["custom"]["trainer_variant"] = "rollout_matching_sft"
    stage2_config["custom"]["coord_soft_ce_w1"] = {"soft_ce_weight": 1.0, "gate_weight": 0.5}
    report = validate_mapping(stage2_config)
    got = {i.path: (i.message, i.hint) for i in report.errors}
    assert got["custom.trainer_variant"][0] == "legacy key, replaced by custom.trainer_variant: stage2_rollout_aligned"
    assert "rollout_matching_sft was renamed" in got["custom.trainer_variant"][1]
    assert got["custom.coord_soft_ce_w1.gate_weight"][0] == (
        "legacy key, replaced by rollout_matching.pipeline.objective[*].config.coord_gate_weight"
    )
    assert "coord_reg" in got["custom.coord_soft_ce_w1.soft_ce_weight"][1]
    assert len(got) == 3


def test_current_trainer_variant_is_not_legacy(stage2_config):
    assert find_legacy_keys(stage2_config) == []


def test_legacy_message_names_the_file_that_set_it(stage2_config, write_yaml):
    base = write_yaml({"training": {"output_dir": "x", "packing_length": 4096}}, "base.yaml")
    del stage2_config["training"]
    stage2_config["extends"] = base.name
    report = validate_config_file(write_yaml(stage2_config, "child.yaml"))
    assert [(i.path, i.file.endswith("base.yaml")) for i in report.errors] == [("training.packing_length", True)]
    assert "derived from global_max_length" in report.errors[0].hint


def test_table_is_well_formed():
    patterns = [e.pattern for e in LEGACY_KEYS]
    assert len(patterns) == len(set(patterns)), "each legacy pattern appears once"
    for entry in LEGACY_KEYS:
        assert entry.guidance.endswith("."), entry.pattern
        assert re.fullmatch(r"[a-z0-9_]+(\.[a-z0-9_*]+|\[\*\])*", entry.pattern), entry.pattern
    assert [p.old for p in LEGACY_PREFIXES] == ["custom.extra.rollout_matching"]
