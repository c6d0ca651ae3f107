"""``coordexp expand-vocab`` on hostile input (issue 37): SRC and DST get ``export-merged``'s checks before any
weight loads (exit 2 naming the file, nothing written, SRC unchanged), and a non-finite checkpoint is never written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app

runner = CliRunner()


@pytest.fixture
def source(tiny_model_dir, tmp_path) -> Path:
    folder = tmp_path / "src"
    shutil.copytree(tiny_model_dir, folder)
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _refused(src: Path, dst: Path, *expected: str) -> str:
    before = _snapshot(src)
    result = runner.invoke(app, ["expand-vocab", str(src), str(dst)])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert "internal error" not in text and "Traceback" not in text, text
    for part in expected:
        assert part in text, text
    assert not (os.path.isdir(dst) and any(dst.iterdir())), "something was written"
    assert _snapshot(src) == before
    return text


def _weights(folder: Path) -> Path:
    return folder / "model.safetensors"


@pytest.mark.parametrize("damage, expected", [
    (lambda s: (s / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000), "config.json"),
    (lambda s: (s / "tokenizer.json").write_bytes(b"\x00garbage"), "tokenizer"),
    (lambda s: [(s / name).unlink() for name in ("tokenizer.json", "tokenizer_config.json") if (s / name).exists()],
     "tokenizer"),
    (lambda s: _weights(s).write_bytes(_weights(s).read_bytes()[:-100]), "model.safetensors"),
])
def test_a_broken_source_is_exit_2_before_any_weight_loads(source, tmp_path, damage, expected):
    damage(source)
    _refused(source, tmp_path / "dst", expected)


@pytest.mark.parametrize("make_dst, expected", [
    (lambda t: (t / "file").write_text("x") and t / "file" / "dst", "which is a file"),
    (lambda t: t / ("x" * 300), "too long"),
    (lambda t: os.symlink(t / "nowhere", t / "dangling") or t / "dangling", "dangling symlink"),
    (lambda t: os.symlink(t / "loop", t / "loop") or t / "loop", "symlink loop"),
    (lambda t: Path("/proc/coordexp-expanded"), "nothing can be created"),
])
def test_an_unusable_destination_is_exit_2_before_any_weight_loads(source, tmp_path, make_dst, expected):
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc")
    work = tmp_path / "work"
    work.mkdir()
    _refused(source, make_dst(work), expected)


def test_non_finite_source_weights_are_never_written(source, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(_weights(source)))
    save_file({name: torch.full_like(t, float("nan")) if t.is_floating_point() else t
               for name, t in tensors.items()}, str(_weights(source)), metadata={"format": "pt"})
    _refused(source, tmp_path / "dst", "non-finite", "nothing was written")


def test_an_intact_source_is_still_expanded(source, tmp_path):
    result = runner.invoke(app, ["expand-vocab", str(source), str(tmp_path / "dst")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "dst" / "config.json").is_file()
