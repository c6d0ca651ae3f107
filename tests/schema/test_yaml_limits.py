"""YAML reading with limits (issue 15 item 2): alias bombs, ``extends`` diamonds and huge files are refused with
exit 2 and a message naming the limit, quickly; files within the limits load as before."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.schema import loader as loader_module
from coordexp.schema.errors import ConfigError
from coordexp.schema.loader import (
    MAX_EXTENDS_DEPTH,
    MAX_EXTENDS_FILES,
    load_merged,
    validate_config_file,
    validate_mapping,
)
from coordexp.schema.yaml_io import MAX_CONFIG_BYTES, MAX_YAML_NODES, YamlReadError, parse_yaml_text

runner = CliRunner()


def _validate_cli(path: Path):
    started = time.perf_counter()
    result = runner.invoke(app, ["validate", str(path)], catch_exceptions=False)
    return result, time.perf_counter() - started


def _alias_bomb(levels: int, fanout: int = 10) -> str:
    """Key ``a`` is a list of ``fanout`` scalars; each next letter is a list of ``fanout`` aliases of the last."""
    names = "abcdefghijklmnop"[:levels]
    lines = [f"a: &a [{','.join(['x'] * fanout)}]"]
    lines += [f"{n}: &{n} [{','.join([f'*{prev}'] * fanout)}]" for prev, n in zip(names, names[1:])]
    return "\n".join(lines) + "\n"


def test_nine_level_alias_bomb_exits_2_naming_the_node_cap(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(9))
    assert len(path.read_bytes()) < 400  # the reproducer: a few hundred bytes, 10**9 nodes once expanded
    result, _ = _validate_cli(path)
    assert result.exit_code == 2
    assert f"more than {MAX_YAML_NODES:,} nodes" in result.output


def test_recursive_alias_is_refused():
    with pytest.raises(YamlReadError, match="recursive alias"):
        parse_yaml_text("a: &a [1, *a]\n")
    with pytest.raises(YamlReadError, match="recursive alias"):
        parse_yaml_text("a: &a {k: *a}\n")


@settings(max_examples=60, deadline=None)
@given(levels=st.integers(1, 7), fanout=st.integers(1, 12))
def test_alias_expansion_is_refused_exactly_above_the_cap(levels, fanout):
    # independent count: a_0 is a sequence of `fanout` scalars, a_i a sequence of `fanout` copies of a_{i-1};
    # the document is its mapping plus, per key, the key scalar and the expanded value
    sizes = [1 + fanout]
    for _ in range(1, levels):
        sizes.append(1 + fanout * sizes[-1])
    expanded = 1 + sum(1 + s for s in sizes)
    text = _alias_bomb(levels, fanout)
    if expanded > MAX_YAML_NODES:
        with pytest.raises(YamlReadError, match="nodes"):
            parse_yaml_text(text)
    else:
        data = parse_yaml_text(text)
        assert len(data) == levels and len(data["abcdefghijklmnop"[levels - 1]]) == fanout


def _diamond(root: Path, depth: int, tail: str = "global_max_length: 16\n") -> Path:
    """``f{i}`` extends ``f{i-1}`` twice: 2**depth reads without deduplication."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "f0.yaml").write_text(tail)
    for i in range(1, depth + 1):
        (root / f"f{i}.yaml").write_text(f"extends: [f{i - 1}.yaml, f{i - 1}.yaml]\nk{i}: {i}\n")
    return root / f"f{depth}.yaml"


def test_twenty_deep_extends_diamond_exits_2_naming_the_depth_cap(tmp_path):
    result, _ = _validate_cli(_diamond(tmp_path, 20))
    assert result.exit_code == 2
    assert f"deeper than {MAX_EXTENDS_DEPTH} files" in result.output


def test_diamond_within_the_depth_cap_reads_each_file_once(tmp_path, monkeypatch):
    reads: list[Path] = []
    real = loader_module.read_yaml_file

    def counting(path):
        reads.append(Path(path).resolve())
        return real(path)

    monkeypatch.setattr(loader_module, "read_yaml_file", counting)
    merged = load_merged(_diamond(tmp_path, 12))
    assert len(reads) == len(set(reads)) == 13
    assert merged.data == {"global_max_length": 16, **{f"k{i}": i for i in range(1, 13)}}
    assert merged.file_of(("k3",)).endswith("f3.yaml") and merged.file_of(("global_max_length",)).endswith("f0.yaml")


def test_a_broken_base_reached_twice_is_reported_once(tmp_path):
    report = validate_config_file(_diamond(tmp_path, 6, tail="a: [1, 2\n"))
    assert len(report.errors) == 1 and "invalid YAML" in report.errors[0].message


def test_linear_chain_at_the_depth_cap_loads_and_one_more_is_refused(tmp_path):
    (tmp_path / "c0.yaml").write_text("v: 0\n")
    for i in range(1, MAX_EXTENDS_DEPTH + 1):
        (tmp_path / f"c{i}.yaml").write_text(f"extends: c{i - 1}.yaml\nv{i}: {i}\n")
    assert load_merged(tmp_path / f"c{MAX_EXTENDS_DEPTH - 1}.yaml").data["v"] == 0  # MAX_EXTENDS_DEPTH files
    with pytest.raises(ConfigError, match="deeper than"):
        load_merged(tmp_path / f"c{MAX_EXTENDS_DEPTH}.yaml")


def test_too_many_distinct_bases_are_refused(tmp_path):
    names = []
    for i in range(MAX_EXTENDS_FILES + 1):
        (tmp_path / f"b{i}.yaml").write_text(f"k{i}: {i}\n")
        names.append(f"b{i}.yaml")
    (tmp_path / "top.yaml").write_text("extends: [" + ", ".join(names) + "]\n")
    with pytest.raises(ConfigError, match=f"more than {MAX_EXTENDS_FILES} files"):
        load_merged(tmp_path / "top.yaml")


def test_one_big_base_listed_many_times_hits_the_merge_budget(tmp_path):
    (tmp_path / "base.yaml").write_text("".join(f"k{i}: {i}\n" for i in range(8000)))
    (tmp_path / "top.yaml").write_text("extends: [" + ", ".join(["base.yaml"] * 40) + "]\n")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="values in total"):
        load_merged(tmp_path / "top.yaml")
    assert time.perf_counter() - started < 30  # generous: the point is that it stops, not how fast


def test_file_of_two_and_a_half_million_keys_hits_the_size_cap(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"".join(b"key_%d: %d\n" % (i, i) for i in range(2_500_000)))
    result, _ = _validate_cli(path)
    assert result.exit_code == 2
    assert f"{MAX_CONFIG_BYTES // 1024} KiB cap" in result.output


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_an_endless_file_is_read_only_up_to_the_cap():
    report = validate_config_file("/dev/zero")
    assert not report.ok and "KiB cap" in report.errors[0].message


def test_a_valid_config_at_the_size_cap_still_validates(stage2_config, tmp_path):
    import yaml

    text = yaml.safe_dump(stage2_config)
    padding = "# " + "x" * 100 + "\n"
    text += padding * ((MAX_CONFIG_BYTES - len(text)) // len(padding))
    assert MAX_CONFIG_BYTES - len(padding) < len(text.encode()) <= MAX_CONFIG_BYTES
    path = tmp_path / "padded.yaml"
    path.write_text(text)
    assert validate_config_file(path).ok


def test_many_stray_keys_are_summarised_not_all_suggested(stage2_config):
    stage2_config.update({f"stray_{i}": i for i in range(5000)})
    report = validate_mapping(stage2_config)
    assert len(report.errors) == loader_module.MAX_REPORTED_ISSUES + 1
    assert report.errors[-1].message.startswith("and about") and "more problem(s)" in report.errors[-1].message


def test_thousands_of_legacy_keys_are_summarised_too():
    report = validate_mapping({"custom": {"extra": {"rollout_matching": {f"k{i}": i for i in range(3000)}}}})
    assert len(report.errors) == loader_module.MAX_REPORTED_ISSUES + 1
    assert report.errors[0].message.startswith("legacy key")
    assert "about" in report.errors[-1].message and int(report.errors[-1].message.split()[2]) >= 2900
