"""Broken checkpoints and bad ``--out`` locations for ``coordexp eval`` (issue 23 item 3): each is exit 2 with a
message naming the file, found before any rollout runs (the rollout entry point is replaced by one that fails the
test), and no result file can overwrite an input. The same checkpoint checks guard ``load_policy`` (train)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.errors import EXIT_INVALID, exit_code_for
from testkit import REPO

runner = CliRunner()


@pytest.fixture(scope="module")
def eval_config(tmp_path_factory, tiny_model_dir):
    """A stage-2 HF config on the tiny model and a 2-image val split."""
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    root = tmp_path_factory.mktemp("eval_hostile")
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
    """Any call of the rollout entry point fails the test: every refusal here must come before it."""
    from coordexp.runtime.train import evaluate as evaluate_module

    def refuse(*args, **kwargs):
        raise AssertionError("run_evaluation started although the input was bad")

    monkeypatch.setattr(evaluate_module, "run_evaluation", refuse)


def _eval(*args):
    return runner.invoke(app, ["eval", *[str(a) for a in args]])


def _text(result) -> str:
    return " ".join(result.output.split())


def _header(path: Path, header: dict) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 8)


def _with_config(d: Path, **text_changes) -> None:
    config = json.loads((d / "config.json").read_text())
    config["text_config"].update(text_changes)
    (d / "config.json").write_text(json.dumps(config))


BROKEN = {
    "empty-config": (lambda d: (d / "config.json").write_text(""), "config.json: not valid JSON"),
    "list-config": (lambda d: (d / "config.json").write_text("[1]"), "config.json: expected a JSON object"),
    "binary-config": (lambda d: (d / "config.json").write_bytes(b"\xff\xfe\x00"), "config.json: not valid JSON"),
    "deep-config": (lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000),
                    "config.json: not valid JSON (nested too deeply)"),
    "no-weights": (lambda d: (d / "model.safetensors").unlink(), "no weights (model.safetensors"),
    "truncated-weights": (lambda d: os.truncate(d / "model.safetensors", 100_000),
                          "model.safetensors: truncated or corrupt safetensors file"),
    "four-byte-weights": (lambda d: os.truncate(d / "model.safetensors", 4), "too short for a safetensors file"),
    "garbage-header": (lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"xx"),
                       "corrupt or truncated safetensors file"),
    "unknown-dtype": (lambda d: _header(d / "model.safetensors", {"w": {"dtype": "F99", "shape": [2],
                                                                        "data_offsets": [0, 8]}}),
                      "corrupt safetensors header (tensor 'w')"),
    "weights-a-directory": (lambda d: ((d / "model.safetensors").unlink(), (d / "model.safetensors").mkdir()),
                            "model.safetensors: not a regular file"),
    "index-missing-shard": (lambda d: ((d / "model.safetensors").unlink(), (d / "model.safetensors.index.json")
                                       .write_text(json.dumps({"weight_map": {"x": "model-1-of-2.safetensors"}}))),
                            "model-1-of-2.safetensors: cannot read (No such file or directory)"),
    "tokenizer-garbage": (lambda d: (d / "tokenizer.json").write_text("{oops"), "tokenizer.json: not valid JSON"),
    "processor-garbage": (lambda d: (d / "processor_config.json").write_text("no"),
                          "processor_config.json: not valid JSON"),
    "more-layers-than-weights": (lambda d: _with_config(d, num_hidden_layers=80, layer_types=["full_attention"] * 80),
                                 "asks for 80 text layers (num_hidden_layers) but the weights hold 2"),
    "more-parameters-than-weights": (lambda d: _with_config(d, intermediate_size=4096),
                                     "but the weights hold"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_checkpoint_is_exit_2_before_any_rollout(eval_config, tiny_model_dir, tmp_path, no_rollout, name):
    breaker, expected = BROKEN[name]
    broken = tmp_path / "checkpoint"
    shutil.copytree(tiny_model_dir, broken)
    breaker(broken)
    result = _eval(eval_config, "--checkpoint", broken, "--out", tmp_path / "out")
    assert result.exit_code == EXIT_INVALID, result.output
    assert expected in _text(result) and "internal error" not in _text(result)


def test_load_policy_refuses_a_truncated_checkpoint_and_mismatched_shapes(tiny_model_dir, tmp_path, eval_config):
    """``train`` loads through load_policy: a truncated file or a config of other shapes is exit 2, not 1."""
    from coordexp.runtime.model.policy import load_policy
    from coordexp.schema.contract import build_contract
    from coordexp.schema.loader import validate_config_file

    run = build_contract(validate_config_file(eval_config).config)
    for breaker, expected in ((lambda d: os.truncate(d / "model.safetensors", 100_000), "truncated"),
                              (lambda d: _with_config(d, intermediate_size=64), "do not have the shapes")):
        broken = tmp_path / f"ckpt-{expected.split()[0]}"
        shutil.copytree(tiny_model_dir, broken)
        breaker(broken)
        import dataclasses

        broken_run = dataclasses.replace(run, model=run.model.model_copy(update={"path": str(broken)}))
        with pytest.raises(Exception) as caught:
            load_policy(broken_run)
        assert exit_code_for(caught.value) == EXIT_INVALID and expected in str(caught.value), caught.value


# --------------------------------------------------------------------------------------------- --out


def _afile(tmp: Path) -> Path:
    (tmp / "afile").write_text("x")
    return tmp / "afile"


def _with(tmp: Path, name: str, make) -> Path:
    folder = tmp / "out"
    folder.mkdir()
    make(folder / name)
    return folder


def _read_only_metrics(path: Path) -> None:
    path.write_text("{}")
    path.chmod(0o444)


BAD_OUT = {
    "a-file": (_afile, "is a regular file, not a directory"),
    "under-a-file": (lambda t: _afile(t) / "sub", "cannot use this path (Not a directory)"),
    "name-too-long": (lambda t: t / ("o" * 300), "300-byte path component"),
    "metrics-a-directory": (lambda t: _with(t, "metrics.json", Path.mkdir), "metrics.json is a directory"),
    "png-a-file": (lambda t: _with(t, "png", lambda p: p.write_text("x")), "png exists and is not a directory"),
    "fifo-inside": (lambda t: _with(t, "coco_gt.json", os.mkfifo), "coco_gt.json is a FIFO"),
    "read-only-result": (lambda t: _with(t, "metrics.json", _read_only_metrics), "metrics.json is read-only"),
}


@pytest.mark.parametrize("name", list(BAD_OUT))
def test_bad_out_is_exit_2_before_any_rollout(eval_config, tmp_path, no_rollout, name):
    make, expected = BAD_OUT[name]
    result = _eval(eval_config, "--limit", "1", "--out", make(tmp_path))
    assert result.exit_code == EXIT_INVALID, result.output
    assert expected in _text(result), _text(result)


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device node needs root")
def test_out_onto_a_character_device_is_refused(eval_config, tmp_path, no_rollout):
    node = tmp_path / "null"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    result = _eval(eval_config, "--out", node)
    assert result.exit_code == EXIT_INVALID and "is a character device" in _text(result)
    assert stat.S_ISCHR(os.lstat(node).st_mode)


def test_results_never_overwrite_the_data(eval_config, tmp_path, no_rollout):
    """A result name that is (a link to) the val file: the outputs would have replaced the data."""
    val = Path(yaml.safe_load(eval_config.read_text())["data"]["val_jsonl"])
    before = val.read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    (out / "predictions.jsonl").symlink_to(val)
    result = _eval(eval_config, "--out", out)
    assert result.exit_code == EXIT_INVALID and "is the input file" in _text(result), result.output
    assert val.read_bytes() == before


def test_results_never_overwrite_the_checkpoint(eval_config, tiny_model_dir, tmp_path, no_rollout):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_model_dir, checkpoint)
    out = tmp_path / "out"
    out.mkdir()
    os.link(checkpoint / "config.json", out / "metrics.json")  # a hard link: same file under the result's name
    before = (checkpoint / "config.json").read_bytes()
    result = _eval(eval_config, "--checkpoint", checkpoint, "--out", out)
    assert result.exit_code == EXIT_INVALID and "is the input file" in _text(result), result.output
    assert (checkpoint / "config.json").read_bytes() == before
