"""Every command's ``--help`` reads whole in an 80-column terminal: Rich cuts a cell that cannot fit with an
ellipsis, and a cut option name (``--no-system-from-c…``) or default cannot be typed or read."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from coordexp.cli.app import app

COMMANDS = sorted(typer.main.get_command(app).commands)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_fits_80_columns_without_a_cut_cell(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    cut = [line for line in result.output.splitlines() if "…" in line]
    assert not cut, "\n".join(cut)
    assert max(len(line) for line in result.output.splitlines()) <= 80


def test_the_command_list_covers_serve_rollout_and_demo():
    assert {"serve-rollout", "demo", "train", "eval"} <= set(COMMANDS)
