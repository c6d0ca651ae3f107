"""``coordexp validate`` passes a config whose named files are absent (CI validates without the data) but says which
ones it did not find and that ``coordexp preflight`` checks them (issue 38)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _config(tmp_path: Path, **data) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({
        "extends": str(EXAMPLES / "demo_stage2.yaml"),
        "model": {"path": "./no-model"},
        "data": {"train_jsonl": "./absent/train.jsonl", "val_jsonl": None, **data},
    }), encoding="utf-8")
    return path


def test_validate_names_each_missing_file_and_still_exits_0(tmp_path):
    result = CliRunner().invoke(app, ["validate", str(_config(tmp_path))], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"not found data.train_jsonl: {tmp_path / 'absent' / 'train.jsonl'}" in text
    assert f"not found model.path: {tmp_path / 'no-model'}" in text
    assert "coordexp preflight" in text and "data.val_jsonl" not in text


def test_validate_json_lists_missing_files_and_none_when_present(tmp_path):
    (tmp_path / "absent").mkdir()
    (tmp_path / "absent" / "train.jsonl").write_text("")
    (tmp_path / "no-model").mkdir()
    result = CliRunner().invoke(app, ["validate", str(_config(tmp_path)), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["missing_files"] == []
    plain = CliRunner().invoke(app, ["validate", str(_config(tmp_path))], catch_exceptions=False)
    assert "not found" not in plain.output and "preflight" not in plain.output
