"""Issue 38's hints that were wrong or missing: a missing ``extends`` base names where it was looked for (the folder
of the file that names it, not the current directory); a word where a number belongs is not told "quoted values are
strings"; ``tuner.target_modules: all-linear`` written as a string (ms-swift's and PEFT's form) is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.schema.loader import validate_config_file
from coordexp.schema.tuner import TunerConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "stage1_cpu.yaml"


def _errors(path: Path) -> list:
    report = validate_config_file(path)
    return list(report.errors)


def test_a_missing_base_names_the_path_read_from_the_files_folder(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    config = folder / "run.yaml"
    config.write_text("extends: base.yaml\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # base.yaml is in neither folder; the hint must name the one actually read
    (issue,) = _errors(config)
    assert issue.path == "extends" and "file not found" in issue.message
    assert str(folder / "base.yaml") in issue.hint and "current directory" not in issue.hint
    (folder / "base.yaml").write_text(EXAMPLE.read_text(encoding="utf-8"), encoding="utf-8")
    assert _errors(config) == []  # found next to the file, whatever the current directory


@pytest.mark.parametrize("value, quoted_hint", [("ten", False), ("'10'", True)])
def test_a_word_for_a_number_is_not_called_a_quoted_number(tmp_path, value, quoted_hint):
    config = tmp_path / "run.yaml"
    config.write_text(f"extends: {EXAMPLE}\ntraining:\n  max_steps: {value}\n", encoding="utf-8")
    (issue,) = _errors(config)
    assert issue.path == "training.max_steps"
    assert ("Quoted values are strings" in issue.hint) is quoted_hint


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz -", min_size=1, max_size=12))
def test_words_never_get_the_quoted_number_hint(word):
    from coordexp.schema.issues import _looks_numeric

    assert not _looks_numeric(word) or word.strip() in {"inf", "nan", "infinity"}


def test_target_modules_all_linear_as_a_string_equals_the_list_form(tmp_path):
    assert TunerConfig(train_type="lora", target_modules="all-linear").target_modules == ["all-linear"]
    config = tmp_path / "run.yaml"
    config.write_text(f"extends: {EXAMPLE}\ntuner:\n  train_type: lora\n  target_modules: all-linear\n",
                      encoding="utf-8")
    assert _errors(config) == []
    with pytest.raises(ValueError):  # any other bare string is not PEFT's list of names
        TunerConfig(train_type="lora", target_modules="q_proj")
