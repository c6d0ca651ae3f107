"""Under ``--json`` stdout carries the result and nothing else. DeepSpeed's logger binds a handler to the stdout it
finds when first imported, and its first warning ("Setting accelerator to CPU") landed before the JSON of
``coordexp demo --json`` / ``train --json`` once deepspeed was installed: a launcher's ``json.loads`` failed."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from coordexp.cli.frame import guarded, write_result

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _noisy_app() -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @guarded
    def run(as_json: bool = typer.Option(False, "--json"), fail: bool = typer.Option(False, "--fail")) -> None:
        print("a library's print")
        logger = logging.getLogger("noisy-library-logger")  # as DeepSpeed's create_logger does at import time
        logger.propagate = False
        logger.addHandler(logging.StreamHandler(stream=sys.stdout))
        logger.warning("a library's warning")
        if fail:
            raise ValueError("bad input")
        write_result(json.dumps({"ok": True}) + "\n")

    return app


@pytest.mark.parametrize("fail", [False, True])
def test_library_output_goes_to_stderr_and_the_result_alone_to_stdout(fail):
    result = CliRunner().invoke(_noisy_app(), ["--json"] + (["--fail"] if fail else []))
    document = json.loads(result.stdout)  # the whole of stdout is the one JSON object
    assert document["ok"] is (not fail)
    assert "a library's print" in result.stderr and "a library's warning" in result.stderr


def test_without_json_library_output_stays_on_stdout():
    result = CliRunner().invoke(_noisy_app(), [])
    assert "a library's print" in result.stdout


@pytest.mark.slow  # trains one step in a fresh process, where DeepSpeed (when installed) is first imported
def test_train_json_stdout_is_one_json_object_in_a_fresh_process(tmp_path):
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "model", seed=0)
    write_synthetic_dataset(tmp_path / "data", n_train=4, n_val=2, seed=0)
    config = tmp_path / "s1.yaml"
    config.write_text(yaml.safe_dump({
        "extends": str(EXAMPLES / "demo_stage1.yaml"),
        "model": {"path": "./model"},
        "data": {"train_jsonl": "./data/train.jsonl", "val_jsonl": None},
        "training": {"output_dir": "./run", "max_steps": 1, "per_device_train_batch_size": 2},
    }), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "coordexp", "train", str(config), "--json"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["global_step"] == 1
