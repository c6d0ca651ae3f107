"""A property over hostile output places (issue 45): for ``train`` (``training.output_dir``), ``init -o`` and
``plot-run --out``, a regular file, a path under a file, a FIFO, a device, a symlink loop, a name over 255 bytes, the
root or a special folder is exit 2 before any work (never 1, never a write), and an input is never written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KINDS = ("file", "under_file", "fifo", "devnull", "loop", "long", "root", "proc", "under_loop")
_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_.-", min_size=1, max_size=20).filter(
    lambda n: n not in (".", ".."))


def _place(root: Path, kind: str, name: str, long_size: int) -> Path:
    plain = root / f"plain-{name}"
    if not plain.exists():
        plain.write_text("user data")
    if kind == "file":
        return plain
    if kind == "under_file":
        return plain / name
    if kind == "fifo":
        fifo = root / f"fifo-{name}"
        if not fifo.exists():
            os.mkfifo(fifo)
        return fifo
    if kind in ("loop", "under_loop"):
        loop = root / f"loop-{name}"
        if not os.path.lexists(loop):
            os.symlink(loop, loop)
        return loop if kind == "loop" else loop / "run"
    if kind == "long":
        return root / ("x" * long_size)
    return Path({"devnull": "/dev/null", "root": "/", "proc": "/proc"}[kind])


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink()
            and not str(p).startswith(str(root / "cache"))}


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(KINDS), name=_NAMES, long_size=st.integers(256, 600))
def test_train_refuses_every_hostile_output_dir(tmp_path_factory, tiny_model_dir, kind, name, long_size):
    root = tmp_path_factory.mktemp("train_out")
    (root / "train.jsonl").write_text("{}\n")
    config = root / "cfg.yaml"
    config.write_text(yaml.safe_dump({
        "extends": str(EXAMPLES / "demo_stage2.yaml"), "global_max_length": 2048,
        "custom": {"trainer_variant": "stage1_sft"}, "model": {"path": str(tiny_model_dir)},
        "data": {"train_jsonl": str(root / "train.jsonl"), "val_jsonl": None},
        "training": {"output_dir": str(_place(root, kind, name, long_size)), "max_steps": 1}}))
    before = _snapshot(root)
    result = CliRunner().invoke(app, ["train", str(config)], catch_exceptions=False)
    assert result.exit_code == 2, (kind, result.output)
    assert "training.output_dir" in result.output
    assert _snapshot(root) == before


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(KINDS + ("input",)), name=_NAMES, long_size=st.integers(256, 600))
def test_plot_run_refuses_every_hostile_out(tmp_path_factory, kind, name, long_size):
    root = tmp_path_factory.mktemp("plot_out")
    run = root / "run"
    run.mkdir()
    (run / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "loss": 1.0}]}))
    if kind == "file":
        return  # an existing regular file is a PNG to replace (not an input): allowed
    target = run / "trainer_state.json" if kind == "input" else _place(root, kind, name, long_size)
    before = _snapshot(root)
    result = CliRunner().invoke(app, ["plot-run", str(run), "--out", str(target)], catch_exceptions=False)
    assert result.exit_code == 2, (kind, result.output)
    assert _snapshot(root) == before


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(KINDS), name=_NAMES, long_size=st.integers(256, 600))
def test_init_refuses_every_hostile_output(tmp_path_factory, tiny_model_dir, kind, name, long_size):
    root = tmp_path_factory.mktemp("init_out")
    (root / "train.jsonl").write_text("{}\n")
    target = _place(root, kind, name, long_size)
    before = _snapshot(root)
    result = CliRunner().invoke(app, ["init", "-o", str(target), "--model", str(tiny_model_dir), "--device", "cpu",
                                      "--train-jsonl", str(root / "train.jsonl")], catch_exceptions=False)
    assert result.exit_code == 2, (kind, result.output)
    assert _snapshot(root) == before
