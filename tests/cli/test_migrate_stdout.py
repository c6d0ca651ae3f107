"""``coordexp migrate`` to stdout exits 0 only when the printed result validates (issue 37): ``-o`` and
``--in-place`` already exited 2 on the same input."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app
from testkit import STAGE2_CONFIG

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "schema"))
from test_migrate_coord_offset import COORD_OFFSET, STAGE1, _chain  # noqa: E402

runner = CliRunner()


def _migrate(*args) -> "object":
    return runner.invoke(app, ["migrate", *map(str, args)], catch_exceptions=False)


@pytest.mark.parametrize("training, sections", [
    ({"weight_decay": float("nan")}, {}),
    ({"deepspeed": "zero3"}, {"tuner": {"train_type": "lora"}, "rollout_matching": {"rollout_backend": "hf"}}),
])
def test_stdout_of_a_canonical_config_that_does_not_validate_exits_2(tmp_path, training, sections):
    config = copy.deepcopy(STAGE2_CONFIG)
    config["training"].update(training)
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    before = path.read_bytes()
    stdout = _migrate(path)
    assert stdout.exit_code == 2, stdout.output
    assert "the printed config still has" in stdout.output
    assert _migrate(path, "-o", tmp_path / "out.yaml").exit_code == 2  # the same verdict as -o
    assert path.read_bytes() == before


@pytest.mark.parametrize("embed_lr", [float("nan"), float("inf"), -1.0, "fast"])
def test_stdout_of_an_upstream_chain_whose_result_does_not_validate_exits_2(tmp_path, embed_lr):
    leaf = _chain(tmp_path, {**STAGE1, "custom": {**STAGE1["custom"],
                                                  "coord_offset": {**COORD_OFFSET, "embed_lr": embed_lr}}})
    result = _migrate(leaf, "--base-dir", tmp_path)
    assert result.exit_code == 2, result.output


def test_stdout_of_a_valid_result_still_exits_0(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(STAGE2_CONFIG), encoding="utf-8")
    result = _migrate(path)
    assert result.exit_code == 0, result.output
    assert "the printed config validates" in result.output
