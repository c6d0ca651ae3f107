"""transformers' and huggingface_hub's progress bars ("Loading weights", "Writing model shards") stay out of logs:
off when stderr is not a terminal, kept on a terminal or when the user asks for them."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordexp.cli.quiet import BARS_ENV, library_bars_quiet

ROOT = Path(__file__).resolve().parents[2]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_on_a_non_terminal_kept_on_a_terminal_or_when_asked(monkeypatch):
    monkeypatch.delenv(BARS_ENV, raising=False)
    assert library_bars_quiet(Terminal()) is False and BARS_ENV not in os.environ
    assert library_bars_quiet(io.StringIO()) is True and os.environ[BARS_ENV] == "1"
    monkeypatch.setenv(BARS_ENV, "0")
    assert library_bars_quiet(io.StringIO()) is False and os.environ[BARS_ENV] == "0"


SCRIPT = """import sys
from coordexp.cli.app import main
try:
    main(["make-tiny-model", sys.argv[1]])
except SystemExit as exc:
    assert exc.code == 0, exc.code
from transformers import AutoModelForImageTextToText
AutoModelForImageTextToText.from_pretrained(sys.argv[1])
print("loaded")
"""


@pytest.mark.slow
def test_no_loading_or_writing_bars_in_a_log(tmp_path):
    """Regression (issue 44): every command printed 'Loading weights' / 'Writing model shards' bars into logs."""
    env = {k: v for k, v in os.environ.items() if k != BARS_ENV}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "tiny")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr
    assert "Writing model shards" not in done.stderr and "Loading weights" not in done.stderr, done.stderr
