"""YAML loading: extends chains, merge rules, cycles, YAML 1.2 scalars, file provenance, path resolution."""

from __future__ import annotations

import os

import pytest

from coordexp.schema.errors import ConfigError
from coordexp.schema.loader import load_config, load_merged, validate_config_file
from coordexp.schema.yaml_io import YamlReadError, parse_yaml_text


def test_extends_deep_merges_dicts_and_replaces_lists(write_yaml):
    write_yaml({"a": {"x": 1, "y": {"p": 1, "q": 2}}, "lst": [1, 2, 3], "keep": "base"}, "base.yaml")
    child = write_yaml({"extends": "base.yaml", "a": {"y": {"q": 20}, "z": 3}, "lst": [9]}, "child.yaml")
    merged = load_merged(child)
    assert merged.data == {"a": {"x": 1, "y": {"p": 1, "q": 20}, "z": 3}, "lst": [9], "keep": "base"}
    assert "extends" not in merged.data


def test_extends_list_applies_in_order_then_the_file(write_yaml):
    write_yaml({"v": 1, "only1": True}, "one.yaml")
    write_yaml({"v": 2, "only2": True}, "two.yaml")
    merged = load_merged(write_yaml({"extends": ["one.yaml", "two.yaml"], "w": 0}, "child.yaml"))
    assert merged.data == {"v": 2, "only1": True, "only2": True, "w": 0}


def test_extends_is_relative_to_the_file_that_names_it(write_yaml, tmp_path, monkeypatch):
    write_yaml({"v": "deep"}, "conf/bases/root.yaml")
    write_yaml({"extends": "bases/root.yaml", "mid": 1}, "conf/mid.yaml")
    leaf = write_yaml({"extends": "../conf/mid.yaml"}, "other/leaf.yaml")
    monkeypatch.chdir(tmp_path / "other")
    assert load_merged(leaf).data == {"v": "deep", "mid": 1}


def test_extends_cycle_names_the_chain(write_yaml):
    write_yaml({"extends": "b.yaml"}, "a.yaml")
    write_yaml({"extends": "c.yaml"}, "b.yaml")
    write_yaml({"extends": "a.yaml"}, "c.yaml")
    with pytest.raises(ConfigError) as info:
        load_merged(write_yaml({"extends": "b.yaml"}, "a.yaml"))
    (issue,) = info.value.issues
    names = [os.path.basename(part) for part in issue.message.removeprefix("extends cycle: ").split(" -> ")]
    assert names == ["a.yaml", "b.yaml", "c.yaml", "a.yaml"]
    assert issue.path == "extends"


def test_self_extension_is_a_cycle(write_yaml):
    with pytest.raises(ConfigError, match="extends cycle"):
        load_merged(write_yaml({"extends": "cfg.yaml"}))


def test_missing_base_is_reported_on_the_extends_key(write_yaml):
    report = validate_config_file(write_yaml({"extends": "nope.yaml"}))
    assert [(i.path, i.message) for i in report.errors] == [("extends", "base 'nope.yaml': file not found")]


@pytest.mark.parametrize("value", [3, {"a": 1}, ["x.yaml", 2]])
def test_extends_type_is_checked(write_yaml, value):
    report = validate_config_file(write_yaml({"extends": value}))
    assert [i.path for i in report.errors] == ["extends"]


def test_diamond_extends_is_not_a_cycle(write_yaml):
    write_yaml({"v": 0}, "root.yaml")
    write_yaml({"extends": "root.yaml", "l": 1}, "left.yaml")
    write_yaml({"extends": "root.yaml", "r": 1}, "right.yaml")
    merged = load_merged(write_yaml({"extends": ["left.yaml", "right.yaml"]}, "top.yaml"))
    assert merged.data == {"v": 0, "l": 1, "r": 1}


def test_issue_names_the_file_that_set_the_key(stage2_config, write_yaml):
    base = dict(stage2_config)
    base["training"] = {"output_dir": "x", "lerning_rate": 1.0}
    write_yaml(base, "base.yaml")
    child = write_yaml({"extends": "base.yaml", "model": {"path": "m", "dtype": "fp8"}}, "child.yaml")
    report = validate_config_file(child)
    files = {i.path: os.path.basename(i.file) for i in report.errors}
    assert files == {"training.lerning_rate": "base.yaml", "model.dtype": "child.yaml"}


def test_overriding_a_subtree_moves_its_provenance(stage2_config, write_yaml):
    base = dict(stage2_config)
    base["training"] = {"output_dir": "x", "typo_a": 1}
    base["model"] = {"path": "m", "typo_b": 1}
    write_yaml(base, "base.yaml")
    child = write_yaml({"extends": "base.yaml", "training": {"typo_a": 2}, "model": "not-a-mapping"}, "c.yaml")
    report = validate_config_file(child)
    assert [(i.path, os.path.basename(i.file)) for i in report.errors] == [
        ("model", "c.yaml"),
        ("training.typo_a", "c.yaml"),
    ]


def test_relative_paths_resolve_against_the_defining_file(stage2_config, write_yaml, tmp_path):
    base = dict(stage2_config)
    base["data"] = {"train_jsonl": "data/train.jsonl", "image_root": "/abs/images"}
    base["model"] = {"path": "./weights"}
    write_yaml(base, "bases/base.yaml")
    child = write_yaml({"extends": "../bases/base.yaml", "training": {"output_dir": "../runs/x"}}, "exp/child.yaml")
    cfg = load_config(child)
    assert cfg.data.train_jsonl == str(tmp_path / "bases" / "data" / "train.jsonl")
    assert cfg.data.image_root == "/abs/images"
    assert cfg.model.path == str(tmp_path / "bases" / "weights")
    assert cfg.training.output_dir == str(tmp_path / "runs" / "x")


def test_hub_ids_are_not_paths(stage2_config, write_yaml):
    assert load_config(write_yaml(stage2_config)).model.path == "Qwen/Qwen2.5-VL-3B-Instruct"


def test_yaml_scalars_follow_yaml_1_2():
    data = parse_yaml_text("a: yes\nb: on\nc: 010\nd: 1:30\ne: true\nf: 1.5e3\ng: 0x1F\nh: ~\ni: 2024-01-01\n")
    assert data == {"a": "yes", "b": "on", "c": 10, "d": "1:30", "e": True, "f": 1500.0, "g": 31, "h": None,
                    "i": "2024-01-01"}


def test_duplicate_keys_are_errors_but_merge_keys_work():
    with pytest.raises(YamlReadError, match="line 3: duplicate key 'a'"):
        parse_yaml_text("a: 1\nb: 2\na: 3\n")
    assert parse_yaml_text("x: &x {p: 1, q: 2}\ny:\n  <<: *x\n  q: 3\n")["y"] == {"p": 1, "q": 3}


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("", "file is empty"),
        ("# only a comment\n", "file is empty"),
        ("- a\n- b\n", "got a list"),
        ("just a string\n", "got a str"),
        ("a: [1, 2\n", "invalid YAML: line 1"),  # where the bracket opens, not past the end of the file
        ("1: one\n", "keys must be strings"),
        ("a: 1\n\tb: 2\n", "invalid YAML"),
    ],
)
def test_unreadable_files_give_one_clear_issue(write_yaml, content, needle):
    report = validate_config_file(write_yaml(content))
    assert len(report.errors) == 1 and needle in report.errors[0].message, report.errors


def test_binary_missing_and_directory(tmp_path):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(bytes(range(256)))
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"a: 1\x00\n")
    cases = {binary: "not a UTF-8 text file", nul: "NUL bytes", tmp_path / "missing.yaml": "file not found",
             tmp_path: "is a directory"}
    for path, needle in cases.items():
        report = validate_config_file(path)
        assert len(report.errors) == 1 and needle in report.errors[0].message


def test_load_config_raises_with_every_issue(stage2_config, write_yaml):
    stage2_config["training"]["zz1"] = 1
    stage2_config["model"]["zz2"] = 2
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(stage2_config))
    assert {i.path for i in info.value.issues} == {"training.zz1", "model.zz2"}
    assert "2 config problem(s)" in str(info.value)
