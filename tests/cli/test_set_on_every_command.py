"""``--set KEY=VALUE`` on ``eval``, ``probe``, ``preflight`` and ``serve-rollout`` (issue 55, item 6): the same
overrides as ``train --set``, validated like the file. The bug it fixes: ``eval --checkpoint`` of a run trained with
``--set training.output_dir=...`` wrote into the config's output_dir, another run's folder. No model loads here."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from coordexp.cli.app import app
from testkit import STAGE2_CONFIG

COMMANDS = (["eval"], ["probe"], ["preflight"], ["serve-rollout", "--port", "0"])


def _run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


@pytest.fixture
def config(write_yaml, tmp_path):
    (tmp_path / "images").mkdir()
    return write_yaml({**STAGE2_CONFIG, "data": {"train_jsonl": "data/train.jsonl", "image_root": "images"},
                       "training": {"output_dir": str(tmp_path / "config_run")}})


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_bad_set_key_exits_2_naming_its_dotted_path(command, config):
    result = _run(*command, str(config), "--set", "training.max_stepz=1")
    assert result.exit_code == 2, result.output
    assert "training.max_stepz" in result.output
    malformed = _run(*command, str(config), "--set", "no_equals_sign")
    assert malformed.exit_code == 2 and "dotted.key=value" in malformed.output


@pytest.mark.parametrize(("command", "module", "function", "folder"), [
    ("eval", "coordexp.runtime.train.evaluate", "run_evaluation", "eval_checkpoint-3"),
    ("probe", "coordexp.runtime.train.probe", "run_probe", "probe_checkpoint-3")])
def test_eval_and_probe_of_a_set_output_dir_write_into_that_run(command, module, function, folder, config, tmp_path,
                                                                 monkeypatch):
    """The checkpoint belongs to the run trained with ``--set training.output_dir=.../other_run``: given the same
    override, the results go to that run's folder and ``measured`` names the override; never the config's run."""
    import coordexp.cli.evaluate as evaluate

    other = tmp_path / "other_run"
    checkpoint = other / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    seen = {}

    def fake(run, **kwargs):
        seen.update(kwargs, output_dir=run.training.output_dir)
        raise typer.Exit(0)

    monkeypatch.setitem(sys.modules, module, SimpleNamespace(**{function: fake}))
    for name in ("require_packages", "check_checkpoint_files"):  # no model is loaded, none is checked
        monkeypatch.setattr(evaluate, name, lambda *a, **k: None)
    import coordexp.cli.probe as probe

    for name in ("require_packages", "check_checkpoint_files"):
        monkeypatch.setattr(probe, name, lambda *a, **k: None)
    result = _run(command, str(config), "--checkpoint", str(checkpoint), "--set", f"training.output_dir={other}")
    assert result.exit_code == 0, result.output
    assert seen["out_dir"] == other / folder and seen["output_dir"] == str(other)
    assert seen["measured"]["overrides"] == [f"training.output_dir={other}"]
    assert not (tmp_path / "config_run").exists()


def test_preflight_and_serve_rollout_check_the_overridden_config(config, tmp_path):
    elsewhere = tmp_path / "elsewhere.jsonl"
    report = _run("preflight", str(config), "--json", "--set", f"data.train_jsonl={elsewhere}")
    assert report.exit_code == 2
    data_checks = [c for c in json.loads(report.stdout)["checks"] if "data" in c["name"]]
    assert data_checks and any(str(elsewhere) in c["detail"] for c in data_checks)
    served = _run("serve-rollout", str(config), "--port", "0", "--set", f"data.image_root={tmp_path / 'nowhere'}")
    assert served.exit_code == 2 and "nowhere" in served.output and "not a directory" in served.output
