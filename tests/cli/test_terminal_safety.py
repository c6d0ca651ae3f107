"""Terminal injection (issue 15 item 5): user-supplied strings reach the terminal with control characters escaped,
through every output path (plain text, Rich markup, JSON)."""

from __future__ import annotations

import io
import json
import unicodedata

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.cli.frame import plain, safe

runner = CliRunner()
EVIL_KEY = "\x1b[2J\x1b[31mEVIL"
BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"


def _raw_controls(text: str, *, allow: str = "\n") -> list[str]:
    """Characters that could drive a terminal: C0/C1 controls, DEL, bidi overrides, line/paragraph separators."""
    return [c for c in text if c not in allow and (unicodedata.category(c) == "Cc" or c in BIDI + "\u2028\u2029")]


def test_validate_escapes_a_hostile_key(stage2_config, write_yaml):
    stage2_config["training"][EVIL_KEY] = 1
    path = write_yaml(stage2_config)
    result = runner.invoke(app, ["validate", str(path)], catch_exceptions=False)
    assert result.exit_code == 2
    assert "\x1b" not in result.output
    assert "\\x1b[2J\\x1b[31mEVIL" in result.output  # shown, escaped, not swallowed as Rich markup


def test_validate_json_escapes_a_hostile_key(stage2_config, write_yaml):
    stage2_config["training"][EVIL_KEY] = 1
    path = write_yaml(stage2_config)
    result = runner.invoke(app, ["validate", "--json", str(path)], catch_exceptions=False)
    assert result.exit_code == 2 and "\x1b" not in result.output
    (report,) = json.loads(result.stdout)
    assert any(EVIL_KEY in error["path"] for error in report["errors"])  # the data survives, JSON-escaped


def test_hostile_file_names_and_values_are_escaped(stage2_config, write_yaml, tmp_path):
    stage2_config["model"]["path"] = "\x1b]0;owned\x07"  # an OSC title-setting sequence as a value
    stage2_config["global_max_length"] = "\x9b31m"  # C1 CSI, one byte on some terminals
    path = write_yaml(stage2_config, "bad\x1b[2Jname.yaml")
    missing = tmp_path / "no\x1b[31msuch\u202e.yaml"
    for args in (["validate", str(path), str(missing)], ["train", str(path)], ["preflight", str(path)],
                 ["migrate", str(missing)]):
        result = runner.invoke(app, args, catch_exceptions=False)
        assert result.exit_code == 2, (args, result.output)
        assert _raw_controls(result.output) == [], (args, result.output)
    assert "bad\\x1b[2Jname.yaml" in runner.invoke(app, ["validate", str(path)]).output


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_plain_leaves_no_control_character_and_keeps_printable_text(text):
    shown = plain(text)
    assert _raw_controls(shown, allow="") == []
    if not _raw_controls(text, allow="") and not text.endswith("\\"):
        assert shown == text  # nothing to escape: unchanged
    multiline = plain(text, multiline=True)
    assert _raw_controls(multiline, allow="\n\t") == []
    assert multiline.count("\n") == text.count("\n")


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
@example("\\")  # Rich's escape doubled a trailing backslash, which then printed twice
@example("C:\\temp\\\\")
def test_safe_prints_exactly_the_escaped_text_through_rich(text):
    """Rich never interprets a user string as markup (``[red]``, ``[/]``, ``[link=...]``) once it went through safe."""
    buffer = io.StringIO()
    Console(file=buffer, highlight=False, soft_wrap=True, width=500, force_terminal=False).print(safe(text), end="")
    assert buffer.getvalue() == plain(text)


@pytest.mark.parametrize(("raw", "shown"), [("\x1b", "\\x1b"), ("\x00", "\\x00"), ("\x7f", "\\x7f"),
                                            ("\x9b", "\\x9b"), ("\u202e", "\\u202e"), ("\n", "\\x0a"),
                                            ("é✓", "é✓")])
def test_escape_forms(raw, shown):
    assert plain(raw) == shown
