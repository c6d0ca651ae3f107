"""``coordexp migrate`` never loses data (issue 12 item 5): atomic writes, numbered byte-identical backups, symlinks
followed, read-only targets and ``-o`` onto the input refused, no temp file left, malformed mappings exit 2."""

from __future__ import annotations

import copy
import os
import stat
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.schema import migrate_io
from coordexp.schema.errors import ConfigError
from coordexp.schema.migrate import migrate_mapping
from coordexp.schema.migrate_io import MigrationRefused, migrate_file

REPO = Path(__file__).resolve().parents[2]
LEGACY = sorted((REPO / "examples" / "legacy").glob("*.yaml"))
runner = CliRunner()

# A legacy config (CRLF line endings, comments) that migrate rewrites: the reproducer of the lossy .bak.
LEGACY_CRLF = (
    "# my tuned run\r\n"
    "global_max_length: 512  # keep\r\n"
    "model: {path: Qwen/Qwen2.5-VL-3B-Instruct}\r\n"
    "data: {train_jsonl: train.jsonl}\r\n"
    "training: {output_dir: runs/x}\r\n"
    "custom:\r\n"
    "  trainer_variant: rollout_matching_sft\r\n"
    "  extra:\r\n"
    "    rollout_matching:\r\n"
    "      temperature: 0.0\r\n"
).encode()


def _run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _no_temp_files(folder: Path) -> bool:
    return not any(name.endswith(migrate_io.TEMP_SUFFIX) or ".tmp" in name for name in _names(folder))


def test_in_place_keeps_a_byte_identical_backup_of_a_crlf_file_with_comments(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(LEGACY_CRLF)
    result = _run("migrate", str(cfg), "--in-place")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cfg.yaml.bak").read_bytes() == LEGACY_CRLF
    assert b"rollout_matching_sft" not in cfg.read_bytes() and b"\r\n" in cfg.read_bytes()
    assert _names(tmp_path) == {"cfg.yaml", "cfg.yaml.bak"}


def test_an_existing_backup_is_never_overwritten(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(LEGACY_CRLF)
    (tmp_path / "cfg.yaml.bak").write_bytes(b"the earlier backup")
    (tmp_path / "cfg.yaml.bak.1").write_bytes(b"an even earlier one")
    assert _run("migrate", str(cfg), "--in-place").exit_code == 0
    assert (tmp_path / "cfg.yaml.bak").read_bytes() == b"the earlier backup"
    assert (tmp_path / "cfg.yaml.bak.1").read_bytes() == b"an even earlier one"
    assert (tmp_path / "cfg.yaml.bak.2").read_bytes() == LEGACY_CRLF


def test_a_backup_name_that_is_a_symlink_is_never_written_through(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"do not touch")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(LEGACY_CRLF)
    (tmp_path / "cfg.yaml.bak").symlink_to(precious)
    (tmp_path / "cfg.yaml.bak.1").symlink_to(tmp_path / "dangling")  # a dangling link is skipped too
    assert _run("migrate", str(cfg), "--in-place").exit_code == 0
    assert precious.read_bytes() == b"do not touch" and not (tmp_path / "dangling").exists()
    assert (tmp_path / "cfg.yaml.bak.2").read_bytes() == LEGACY_CRLF


def test_output_naming_the_input_is_refused_without_in_place(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(LEGACY_CRLF)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.yaml").symlink_to(cfg)
    for spelling in (str(cfg), str(tmp_path / "sub" / ".." / "cfg.yaml"), str(tmp_path / "link.yaml")):
        result = _run("migrate", str(cfg), "-o", spelling)
        assert result.exit_code == 2 and "--in-place" in result.output
    assert cfg.read_bytes() == LEGACY_CRLF and _names(tmp_path) == {"cfg.yaml", "sub", "link.yaml"}


def test_read_only_file_and_folder_are_refused_even_for_root(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(LEGACY_CRLF)
    cfg.chmod(0o444)
    try:
        result = _run("migrate", str(cfg), "--in-place")
        assert result.exit_code == 2 and "read-only" in result.output
        assert cfg.read_bytes() == LEGACY_CRLF and _names(tmp_path) == {"cfg.yaml"}
        out_dir = tmp_path / "ro"
        out_dir.mkdir()
        out_dir.chmod(0o555)
        result = _run("migrate", str(cfg), "-o", str(out_dir / "new.yaml"))
        assert result.exit_code == 2 and "read-only" in result.output and not any(out_dir.iterdir())
    finally:
        cfg.chmod(0o644)
        (tmp_path / "ro").chmod(0o755)


def test_a_symlinked_config_stays_a_symlink_and_its_target_is_rewritten(tmp_path):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    target = real_dir / "cfg.yaml"
    target.write_bytes(LEGACY_CRLF)
    link = tmp_path / "cfg.yaml"
    link.symlink_to(target)
    assert _run("migrate", str(link), "--in-place").exit_code == 0
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert b"rollout_matching_sft" not in target.read_bytes()
    assert (real_dir / "cfg.yaml.bak").read_bytes() == LEGACY_CRLF
    assert _no_temp_files(real_dir) and _no_temp_files(tmp_path)


def test_output_through_a_symlink_writes_its_target(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(LEGACY_CRLF)
    out_target = tmp_path / "out_real.yaml"
    out_target.write_text("old: 1\n")
    (tmp_path / "out.yaml").symlink_to(out_target)
    assert _run("migrate", str(cfg), "-o", str(tmp_path / "out.yaml")).exit_code == 0
    assert (tmp_path / "out.yaml").is_symlink() and b"stage2_rollout_aligned" in out_target.read_bytes()


def test_a_failed_rename_leaves_no_temp_file_and_the_original_intact(tmp_path, monkeypatch):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(LEGACY_CRLF)

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(migrate_io.os, "replace", failing_replace)
    result = _run("migrate", str(cfg), "--in-place")
    assert result.exit_code == 2 and "No space left" in result.output
    assert cfg.read_bytes() == LEGACY_CRLF and _no_temp_files(tmp_path)
    result = _run("migrate", str(cfg), "-o", str(tmp_path / "new.yaml"))
    assert result.exit_code == 2 and not (tmp_path / "new.yaml").exists() and _no_temp_files(tmp_path)


def test_unchanged_file_in_place_writes_nothing(stage2_config, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(stage2_config))
    before = cfg.read_bytes()
    assert _run("migrate", str(cfg), "--in-place").exit_code == 0
    assert cfg.read_bytes() == before and _names(tmp_path) == {"cfg.yaml"}


@pytest.mark.parametrize(
    ("section", "value", "path"),
    [
        ("rollout_matching", None, None),  # null is an empty section: fine
        ("rollout_matching", [1, 2], "rollout_matching"),
        ("custom", "text", "custom"),
        ("training", 5, "training"),
        ("rollout_matching.vllm", [], "rollout_matching.vllm"),
        ("rollout_matching.pipeline.objective", 3, "rollout_matching.pipeline.objective"),
        ("rollout_matching.pipeline.objective", [1], "rollout_matching.pipeline.objective[0]"),
        ("rollout_matching.pipeline.objective", [{"name": "coord_reg", "config": 3}],
         "rollout_matching.pipeline.objective[0].config"),
        ("custom.extra.rollout_matching.decoding", "x", "custom.extra.rollout_matching.decoding"),
    ],
)
def test_malformed_sections_exit_2_with_the_dotted_path(tmp_path, section, value, path):
    data = {"custom": {"trainer_variant": "rollout_matching_sft", "coord_soft_ce_w1": {"w1_weight": 0.5}},
            "training": {"packing_length": 512}, "rollout_matching": {"temperature": 0.0}}
    node = data
    *parents, last = section.split(".")
    for part in parents:
        node = node.setdefault(part, {}) if isinstance(node.get(part), dict) or part not in node else node[part]
    node[last] = value
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))
    result = _run("migrate", str(cfg))
    if path is None:
        assert result.exit_code in (0, 2) and "internal error" not in result.output
        return
    assert result.exit_code == 2 and f"{path}: expected a" in result.output, result.output
    assert "internal error" not in result.output


# --- properties ------------------------------------------------------------------------------------------------

_JUNK = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.booleans(), st.lists(st.integers(), max_size=2),
                  st.just({}), st.just([{"name": "coord_reg", "config": 1}]))


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*path, i))


LEGACY_DATA = [yaml.safe_load(p.read_text()) for p in LEGACY]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_migrate_mapping_never_crashes_on_malformed_sections(data):
    raw = copy.deepcopy(data.draw(st.sampled_from(LEGACY_DATA)))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from([p for p in _paths(raw) if p]))
        node = raw
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = copy.deepcopy(data.draw(_JUNK))  # st.just values are shared: never mutate them
    try:
        migrate_mapping(raw)
    except ConfigError as exc:
        assert all(issue.path for issue in exc.issues)


_LINE = st.one_of(
    st.sampled_from(["custom:", "  trainer_variant: rollout_matching_sft", "  extra:", "    rollout_matching:",
                     "      temperature: 0.0", "      decode_batch_size: 2", "# a comment", "", "training:",
                     "  packing_length: 512", "global_max_length: 512", "rollout_matching: [1", "- x", "a: &a [*a]",
                     "\t", "model: {path: m}"]),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_LINE, max_size=12), newline=st.sampled_from(["\n", "\r\n"]),
       prior_backup=st.booleans(), in_place=st.booleans())
def test_after_migrate_the_original_bytes_are_in_place_or_in_a_backup(tmp_path_factory, lines, newline,
                                                                       prior_backup, in_place):
    folder = tmp_path_factory.mktemp("mig")
    cfg = folder / "cfg.yaml"
    original = newline.join(lines).encode("utf-8")
    cfg.write_bytes(original)
    if prior_backup:
        (folder / "cfg.yaml.bak").write_bytes(b"older backup")
    try:
        migrate_file(cfg, in_place=in_place, output=None if in_place else folder / "out.yaml")
    except (ConfigError, MigrationRefused, migrate_io.YamlReadError):
        pass  # refused: nothing may have changed
    backups = [p for p in folder.iterdir() if p.name.startswith("cfg.yaml.bak")]
    assert cfg.read_bytes() == original or any(b.read_bytes() == original for b in backups)
    if prior_backup:
        assert (folder / "cfg.yaml.bak").read_bytes() == b"older backup"
    assert _no_temp_files(folder)
    assert {p.name for p in folder.iterdir()} <= {"cfg.yaml", "out.yaml", "cfg.yaml.bak", "cfg.yaml.bak.1"}


def test_every_legacy_example_round_trips_through_in_place_with_its_bytes_backed_up(tmp_path):
    for path in LEGACY:
        cfg = tmp_path / path.name
        cfg.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
        result = migrate_file(cfg, in_place=True)
        assert result.backup is not None and result.backup.read_bytes() == path.read_bytes().replace(b"\n", b"\r\n")
    assert _no_temp_files(tmp_path)
    mode = stat.S_IMODE(os.stat(tmp_path / LEGACY[0].name).st_mode)
    assert mode & stat.S_IWUSR  # the rewritten file keeps a usable mode (mkstemp's 0600 is replaced)
