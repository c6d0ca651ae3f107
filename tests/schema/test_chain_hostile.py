"""Broken parents of a config chain (issue 30 item 3): an ``extends:`` (or upstream ``inherit:``) parent that is a
symlink loop, a dangling symlink, a directory, a FIFO or a file that cannot be read is exit 2 naming that file, for
``validate``, ``migrate`` (``-o``, stdout, ``--in-place``) and ``train``; no traceback, no file changed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app

runner = CliRunner()


def _loop(folder: Path) -> str:
    (folder / "loop_a.yaml").symlink_to("loop_b.yaml")
    (folder / "loop_b.yaml").symlink_to("loop_a.yaml")
    return "loop_a.yaml"


def _dangling(folder: Path) -> str:
    (folder / "gone.yaml").symlink_to("never_written.yaml")
    return "gone.yaml"


def _directory(folder: Path) -> str:
    (folder / "base_dir.yaml").mkdir()
    return "base_dir.yaml"


def _fifo(folder: Path) -> str:
    os.mkfifo(folder / "pipe.yaml")
    return "pipe.yaml"


def _unreadable(folder: Path) -> str:
    with open(folder / "locked.yaml", "w", encoding="utf-8") as handle:  # not Path.open (deny_reading)
        handle.write("global_max_length: 64\n")
    return "locked.yaml"


PARENTS = {"symlink loop": (_loop, "symlink loop"), "dangling symlink": (_dangling, "missing"),
           "directory": (_directory, "directory"), "fifo": (_fifo, "FIFO"),
           "unreadable": (_unreadable, "Permission denied")}


@pytest.fixture
def deny_reading(monkeypatch):
    """Make opening ``locked.yaml`` fail as it does for a file without the read permission (root ignores modes),
    through ``Path.open`` and ``os.open``."""
    real_open = Path.open

    def guarded_open(self, *args, **kwargs):
        if self.name == "locked.yaml":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", guarded_open)
    real_os_open = os.open

    def guarded_os_open(path, *args, **kwargs):  # the bounded reader opens with os.open (fstat, no reopen)
        if os.path.basename(os.fspath(path)) == "locked.yaml":
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_os_open)


def _leaf(folder: Path, key: str, parent: str) -> Path:
    leaf = folder / "leaf.yaml"
    leaf.write_text(f"{key}: {parent}\nglobal_max_length: 64\n", encoding="utf-8")
    return leaf


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry of ``folder``: a regular file's bytes, a symlink's target, else its kind."""
    seen: dict[str, bytes | str] = {}
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink():
            seen[entry.name] = "-> " + os.readlink(entry)
        elif entry.is_file():
            with open(entry, "rb") as handle:  # not Path.open, which deny_reading patches
                seen[entry.name] = handle.read()
        else:
            seen[entry.name] = "dir" if entry.is_dir() else "special"
    return seen


def _assert_refused(result, parent: str, reason: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    assert parent in result.output, result.output  # the broken file is named
    assert reason.lower() in result.output.lower(), result.output


COMMANDS = {
    "validate": lambda leaf: ["validate", str(leaf)],
    "migrate -o": lambda leaf: ["migrate", str(leaf), "-o", str(leaf.parent / "out" / "flat.yaml")],
    "migrate stdout": lambda leaf: ["migrate", str(leaf)],
    "migrate --in-place": lambda leaf: ["migrate", str(leaf), "--in-place"],
    "train": lambda leaf: ["train", str(leaf)],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("kind", list(PARENTS))
def test_a_broken_extends_parent_is_exit_2_naming_it(tmp_path, deny_reading, kind, command):
    make, reason = PARENTS[kind]
    parent = make(tmp_path)
    leaf = _leaf(tmp_path, "extends", parent)
    (tmp_path / "out").mkdir()
    before = _snapshot(tmp_path)
    result = runner.invoke(app, COMMANDS[command](leaf), catch_exceptions=False)
    _assert_refused(result, parent, reason)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["migrate -o", "migrate stdout", "migrate --in-place"])
@pytest.mark.parametrize("kind", list(PARENTS))
def test_a_broken_upstream_inherit_parent_is_exit_2_naming_it(tmp_path, deny_reading, kind, command):
    """``migrate`` follows upstream's ``inherit:`` (validate and train refuse the key itself, naming extends)."""
    make, reason = PARENTS[kind]
    parent = make(tmp_path)
    leaf = _leaf(tmp_path, "inherit", parent)
    (tmp_path / "out").mkdir()
    before = _snapshot(tmp_path)
    result = runner.invoke(app, COMMANDS[command](leaf), catch_exceptions=False)
    _assert_refused(result, parent, reason)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["validate", "migrate stdout", "train"])
def test_the_config_itself_a_symlink_loop_is_exit_2(tmp_path, command):
    leaf = tmp_path / _loop(tmp_path)
    result = runner.invoke(app, COMMANDS[command](leaf), catch_exceptions=False)
    _assert_refused(result, leaf.name, "symlink loop")


def test_a_loop_two_levels_up_names_the_file_that_links_to_it(tmp_path):
    """leaf -> middle -> loop: the report names the loop and the file whose extends reached it."""
    loop = _loop(tmp_path)
    (tmp_path / "middle.yaml").write_text(f"extends: {loop}\n", encoding="utf-8")
    leaf = _leaf(tmp_path, "extends", "middle.yaml")
    result = runner.invoke(app, ["validate", str(leaf)], catch_exceptions=False)
    _assert_refused(result, loop, "symlink loop")
    assert "middle.yaml" in result.output
