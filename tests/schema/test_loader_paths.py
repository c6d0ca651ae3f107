"""Hostile ``extends`` paths (issue 15 item 3): a 300-character name, a NUL byte or a folder that cannot be read is
a config problem of the file that names it (exit 2 from ``coordexp validate``), never an internal error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.schema.loader import validate_config_file

runner = CliRunner()


def _extending(tmp_path: Path, base: str) -> Path:
    path = tmp_path / "child.yaml"
    path.write_text(f"extends: {base}\n", encoding="utf-8")
    return path


def _only_issue(path: Path):
    report = validate_config_file(path)
    assert not report.ok
    (issue,) = report.errors
    return issue


@pytest.mark.parametrize("base, reason", [
    ("x" * 300 + ".yaml", "File name too long"),
    ('"a\\0b.yaml"', "embedded null byte"),
])
def test_unusable_extends_names_are_config_issues(tmp_path, base, reason):
    issue = _only_issue(_extending(tmp_path, base))
    assert issue.path == "extends" and reason in issue.message and "\x00" not in issue.message
    assert "255 bytes" in issue.hint
    result = runner.invoke(app, ["validate", str(tmp_path / "child.yaml")], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output


def test_extends_into_a_folder_that_cannot_be_read(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "base.yaml").write_text("global_max_length: 64\n", encoding="utf-8")
    real_exists, real_resolve = Path.exists, Path.resolve

    def refuse(name):  # what stat() raises under a folder without the x permission (root ignores modes)
        def check(self, *args, **kwargs):
            if locked in self.parents:
                raise PermissionError(13, "Permission denied", str(self))
            return (real_exists if name == "exists" else real_resolve)(self, *args, **kwargs)
        return check

    monkeypatch.setattr(Path, "exists", refuse("exists"))
    real_open = os.open

    def refuse_open(path, *args, **kwargs):  # the bounded reader opens the name once (os.open), then fstat
        if locked in Path(os.fspath(path)).parents:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_open)
    issue = _only_issue(_extending(tmp_path, "locked/base.yaml"))
    assert issue.path == "extends" and "Permission denied" in issue.message
    monkeypatch.setattr(Path, "resolve", refuse("resolve"))
    issue = _only_issue(_extending(tmp_path, "locked/base.yaml"))
    assert issue.path == "extends" and "cannot use this path (Permission denied)" in issue.message
