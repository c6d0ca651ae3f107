"""``coordexp init`` against hostile model folders and races (issues 43 and 45): the model's config.json and
tokenizer files read with bounds (deep JSON, a FIFO), a file that appears before the write is never replaced, and a
folder whose path is not UTF-8 is a clear exit 2."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app


def _init(tmp_path: Path, model: Path, output: Path):
    data = tmp_path / "train.jsonl"
    if not data.exists():
        data.write_text("{}\n")
    return CliRunner().invoke(app, ["init", "-o", str(output), "--model", str(model), "--device", "cpu",
                                    "--train-jsonl", str(data)], catch_exceptions=False)


def test_a_deep_model_config_is_exit_2(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    result = _init(tmp_path, model, tmp_path / "cfg.yaml")
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "cfg.yaml").exists()


def test_a_tokenizer_fifo_does_not_hang_init(tmp_path, tiny_model_dir):
    from coordexp.cli.init import _has_coord_tokens

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").unlink()
    os.mkfifo(model / "tokenizer.json")
    answer: list[bool] = []
    reader = threading.Thread(target=lambda: answer.append(_has_coord_tokens(model)), daemon=True)
    reader.start()
    reader.join(20)
    assert not reader.is_alive() and len(answer) == 1


def test_a_file_that_appears_before_the_write_is_never_replaced(tmp_path, tiny_model_dir, monkeypatch):
    from coordexp.cli import file_guard

    output = tmp_path / "cfg.yaml"
    checked = file_guard.check_output_file

    def check_then_race(path, inputs, what="--output"):
        real = checked(path, inputs, what)
        output.write_text("somebody else's file\n")  # appears between the check and the write
        return real

    monkeypatch.setattr(file_guard, "check_output_file", check_then_race)
    result = _init(tmp_path, tiny_model_dir, output)
    assert result.exit_code == 2, result.output
    assert output.read_text() == "somebody else's file\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".coordexp-write-")] == []


def test_a_folder_whose_path_is_not_utf8_is_exit_2(tmp_path, tiny_model_dir):
    folder = os.path.join(os.fsencode(tmp_path), b"caf\xe9")
    try:
        os.mkdir(folder)
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses non-UTF-8 names")
    where = Path(os.fsdecode(folder))
    result = _init(tmp_path, tiny_model_dir, where / "cfg.yaml")
    assert result.exit_code == 2, result.output
    assert os.listdir(folder) == []


@pytest.mark.parametrize("name", ["...yaml", "..yaml"])
def test_a_config_named_only_by_dots_gets_its_own_run_folder(tmp_path, tiny_model_dir, name):
    """Regression (issue 56, item 25): ``init -o ...yaml`` wrote ``output_dir: ./runs/..`` (the config's own folder)
    and ``-o ..yaml`` ``./runs/.``."""
    import yaml

    result = _init(tmp_path, tiny_model_dir, tmp_path / name)
    assert result.exit_code == 0, result.output
    written = yaml.safe_load((tmp_path / name).read_text())["training"]["output_dir"]
    assert Path(written).parts[-2:] == ("runs", "run")
