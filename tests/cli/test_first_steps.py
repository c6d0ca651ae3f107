"""First steps of issue 44: `coordexp --help` in workflow order, init's learning rate follows the model's size,
convert says when the images are not where the records point, export-merged of a full fine-tune says what it is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from typer.testing import CliRunner

from coordexp.cli.app import WORKFLOW, app
from coordexp.cli.init import PRETRAINED_BYTES, STAGE1_LR, weight_bytes

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_help_lists_the_commands_in_workflow_order():
    """Regression: --help began with validate, schema, migrate, make-tiny-model (registration order)."""
    lines = _run("--help").output.splitlines()
    listed = [m.group(1) for line in lines if (m := re.match(r"^│ ([a-z][a-z-]+) ", line))]
    assert listed[:len(WORKFLOW)] == list(WORKFLOW) and set(listed) >= set(WORKFLOW)


def _checkpoint(folder: Path, weights: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    (folder / "tokenizer.json").write_text(json.dumps({"added_tokens": ["<|coord_999|>"]}))
    with open(folder / "model.safetensors", "wb") as handle:  # sparse: the size is all init reads
        handle.truncate(weights)
    return folder


def test_init_on_cpu_writes_a_pretrained_models_rate_for_a_real_model(tmp_path):
    """Regression: `init --device cpu` wrote the tiny model's 1e-3 for a 3B model too."""
    (tmp_path / "train.jsonl").write_text("")
    rates = {}
    for name, size in (("tiny", 5 * 2**20), ("big", PRETRAINED_BYTES + 1)):
        model = _checkpoint(tmp_path / name, size)
        assert weight_bytes(model) == size
        result = _run("init", "-o", tmp_path / f"{name}.yaml", "--model", model, "--train-jsonl",
                      tmp_path / "train.jsonl", "--device", "cpu")
        assert result.exit_code == 0, result.output
        rates[name] = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())["training"]["learning_rate"]
    assert rates == {"tiny": STAGE1_LR["cpu"], "big": STAGE1_LR["gpu"]}


def _coco(tmp_path: Path) -> Path:
    source = tmp_path / "instances.json"
    source.write_text(json.dumps({
        "images": [{"id": 1, "width": 64, "height": 48, "file_name": "one.jpg"}],
        "categories": [{"id": 4, "name": "cat"}],
        "annotations": [{"id": 10, "image_id": 1, "category_id": 4, "bbox": [4, 4, 20, 20], "iscrowd": 0}]}))
    return source


def test_convert_says_when_the_images_are_not_where_the_records_point(tmp_path):
    """Regression: a wrong --image-prefix was found only by train, after the weights loaded, one line per record."""
    source = _coco(tmp_path)
    result = _run("convert", "to-jsonl", source, "-o", tmp_path / "train.jsonl", "--image-prefix", "val2017/")
    assert result.exit_code == 0 and "! not found 1 of 1 images" in " ".join(result.output.split()), result.output
    assert "val2017/one.jpg" in result.output and "--image-prefix" in result.output
    (tmp_path / "val2017").mkdir()
    (tmp_path / "val2017" / "one.jpg").write_bytes(b"")  # in place but unreadable: convert opens what is in place
    result = _run("convert", "to-jsonl", source, "-o", tmp_path / "train2.jsonl", "--image-prefix", "val2017/")
    assert result.exit_code == 2 and "one.jpg" in result.output and not (tmp_path / "train2.jsonl").exists()
    from PIL import Image

    Image.new("RGB", (64, 48)).save(tmp_path / "val2017" / "one.jpg")
    result = _run("convert", "to-jsonl", source, "-o", tmp_path / "train2.jsonl", "--image-prefix", "val2017/",
                  "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["missing_images"] == 0


def test_export_merged_of_a_full_fine_tune_says_it_already_is_a_checkpoint(tmp_path):
    """Regression: it said `adapter_config.json: cannot read`."""
    run = _checkpoint(tmp_path / "run", 1024)
    result = runner.invoke(app, ["export-merged", str(run), str(tmp_path / "merged")])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "full fine-tune" in text and f"model.path: {run}" in text and "cannot read" not in text
    assert not (tmp_path / "merged").exists()
