"""``coordexp eval --checkpoint DIR`` on a checkpoint whose tokenizer (or processor) cannot be loaded (issue 30 item
5): exit 2 naming the directory, before any rollout (the rollout entry point fails the test if reached)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app
from testkit import REPO

runner = CliRunner()


@pytest.fixture(scope="module")
def eval_config(tmp_path_factory, tiny_model_dir):
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    root = tmp_path_factory.mktemp("eval_tokenizer")
    data = write_synthetic_dataset(root / "data", n_train=2, n_val=2, seed=0)
    config = {
        "extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"),
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_jsonl": str(data.train_jsonl), "val_jsonl": str(data.val_jsonl)},
        "training": {"output_dir": str(root / "run")},
    }
    path = root / "eval.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def no_rollout(monkeypatch):
    from coordexp.runtime.train import evaluate as evaluate_module

    def refuse(*args, **kwargs):
        raise AssertionError("run_evaluation started although the checkpoint has no usable tokenizer")

    monkeypatch.setattr(evaluate_module, "run_evaluation", refuse)


def _remove(*names: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        for name in names:
            (folder / name).unlink()
    return change


def _write(name: str, content: object) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        (folder / name).write_text(json.dumps(content), encoding="utf-8")
    return change


BROKEN = {
    "no tokenizer.json": _remove("tokenizer.json"),
    "no tokenizer files at all": _remove("tokenizer.json", "tokenizer_config.json"),
    "tokenizer.json an empty object": _write("tokenizer.json", {}),
    "tokenizer.json of the wrong shape": _write("tokenizer.json", {"version": "1.0", "model": {"type": "BPE",
                                                                                            "vocab": 5}}),
}
"""(With no tokenizer files at all transformers builds an empty Qwen2Tokenizer: unusable, it has no coord tokens.)"""


@pytest.mark.parametrize("case", list(BROKEN))
def test_eval_on_a_checkpoint_without_a_usable_tokenizer_is_exit_2_before_any_rollout(
        tmp_path, eval_config, tiny_model_dir, no_rollout, case):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_model_dir, checkpoint)
    BROKEN[case](checkpoint)
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    result = runner.invoke(app, ["eval", str(eval_config), "--checkpoint", str(checkpoint), "--out",
                                 str(tmp_path / "out"), "--limit", "1"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert "Traceback" not in text and "internal error" not in text, text
    assert str(checkpoint) in text and "tokenizer" in text.lower(), text
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before
