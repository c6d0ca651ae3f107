"""The demo orchestration end to end with tiny step caps (``coordexp demo --quick`` on configs in a tmp dir)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
runner = CliRunner()


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _configs(root: Path) -> tuple[Path, Path]:
    """The demo's configs, redirected into ``root`` and shortened (tiny rollouts keep the test fast)."""
    short = {"decode_batch_size": 4, "max_new_tokens": 24}
    stage1 = _write(root / "s1.yaml", {
        "extends": str(EXAMPLES / "demo_stage1.yaml"),
        "model": {"path": "./assets/model"},
        "data": {"train_jsonl": "./assets/data/train.jsonl", "val_jsonl": "./assets/data/val.jsonl"},
        "training": {"output_dir": "./runs/s1", "per_device_train_batch_size": 4},
        "rollout_matching": short,
    })
    stage2 = _write(root / "s2.yaml", {
        "extends": str(EXAMPLES / "demo_stage2.yaml"),
        "global_max_length": 2048,
        "model": {"path": "./runs/s1"},
        "data": {"train_jsonl": "./assets/data/train.jsonl", "val_jsonl": "./assets/data/val.jsonl"},
        "training": {"output_dir": "./runs/s2", "per_device_train_batch_size": 2, "logging_steps": 1},
        "rollout_matching": short,
    })
    return stage1, stage2


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    stage1, stage2 = _configs(root)
    result = runner.invoke(app, ["demo", "--quick", "--json", "--stage1", str(stage1), "--stage2", str(stage2)],
                           catch_exceptions=False)
    return root, result


@pytest.mark.slow  # trains both stages
def test_quick_demo_runs_both_stages_and_reports_before_and_after(quick_demo):
    from coordexp.cli.demo import QUICK_STEPS

    root, result = quick_demo
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (root / "assets" / "model" / "config.json").is_file()  # built on first use
    assert summary["stage1_steps"] == QUICK_STEPS["stage1"]  # a random model never reaches the parse target
    assert summary["stage1_reached_target"] is False
    assert [c["step"] for c in summary["stage1_checks"]] == [2]  # every 2 steps, not at the final step
    assert summary["stage2_steps"] == QUICK_STEPS["stage2"]
    for point in ("before_stage2", "after_stage2"):
        counters = summary[point]["counters"]
        assert counters["samples"] == QUICK_STEPS["eval_records"]
        assert counters["fn_appended"] == counters["gt_objects"] - counters["matched"]
        assert summary[point]["loss"] > 0
        assert 0.0 <= summary[point]["box_AP50"] <= 1.0  # COCO AP50 of the val rollouts
        figures = summary[point]["figures"]  # and the set figures of the same rollouts (issue 42)
        assert figures["pred_per_gt"] == pytest.approx(counters["pred_valid"] / counters["gt_objects"])
        assert 0.0 <= figures["recall"] <= 1.0
    assert summary["stage1_dir"] == str(root / "runs" / "s1")
    # stage 2 started from the stage-1 model, which was saved with its processor
    assert (root / "runs" / "s1" / "model.safetensors").is_file() and (root / "runs" / "s1" / "tokenizer.json").is_file()
    assert (root / "runs" / "s2" / "model.safetensors").is_file()
    assert json.loads((root / "runs" / "s2" / "demo_summary.json").read_text())["pngs"] == summary["pngs"]


@pytest.mark.slow  # trains both stages
def test_quick_demo_writes_pngs_of_the_final_evaluation(quick_demo):
    from PIL import Image

    from coordexp.runtime.train.visualize import read_rollout_log

    root, result = quick_demo
    summary = json.loads(result.stdout)
    assert 1 <= len(summary["pngs"]) <= 4
    for path in map(Path, summary["pngs"]):
        assert path.parent == root / "runs" / "s2" / "demo_png"
        with Image.open(path) as image:
            # 112 px upscaled to the legible minimum canvas side, under the caption band (name, step, raw text)
            assert image.size[0] == 672 and image.size[1] > 672
    final = [e for e in read_rollout_log(root / "runs" / "s2") if e.tag == "eval" and e.step == summary["stage2_steps"]]
    assert len(final) == QUICK_EVAL_RECORDS
    assert any(e.tag == "train" for e in read_rollout_log(root / "runs" / "s2"))  # logging_steps 1


QUICK_EVAL_RECORDS = 4


def test_demo_refuses_to_clear_a_directory_it_did_not_create(tmp_path):
    from coordexp.runtime.toy.demo import RUN_MARKER, _claim_output_dir
    from coordexp.runtime.train.launch import LaunchError

    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "weights.bin").write_text("x")
    with pytest.raises(LaunchError, match="not written by the demo"):
        _claim_output_dir(str(foreign))
    assert (foreign / "weights.bin").is_file()
    mine = tmp_path / "mine"
    _claim_output_dir(str(mine))
    (mine / "old.txt").write_text("stale")
    _claim_output_dir(str(mine))  # a demo-made directory is cleared for the next run
    assert sorted(p.name for p in mine.iterdir()) == [RUN_MARKER]


@pytest.fixture
def fake_model_builds(monkeypatch):
    """Record ``build_tiny_model`` calls instead of building (the quick demo test builds a real one)."""
    import coordexp.runtime.toy.tiny_model as tiny_model

    calls: list[dict] = []

    def fake_build(path, **kwargs):
        calls.append(kwargs)
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")
        return Path(path)

    monkeypatch.setattr(tiny_model, "build_tiny_model", fake_build)
    return calls


def test_ensure_assets_reuses_what_its_manifest_matches_and_rebuilds_on_change(tmp_path, fake_model_builds):
    from dataclasses import replace

    from coordexp.runtime.toy.demo import ASSET_MANIFEST, DemoPlan, ensure_assets
    from coordexp.schema.contract import load_contract

    stage1, stage2 = _configs(tmp_path)
    run = load_contract(stage1)
    plan = DemoPlan(stage1, stage2, n_train=3, n_val=1)
    messages: list[str] = []
    ensure_assets(run, plan, messages.append)
    ensure_assets(run, plan, messages.append)
    ensure_assets(run, replace(plan, n_train=5), messages.append)
    ensure_assets(run, replace(plan, n_train=5, init_std=0.05), messages.append)
    assert [m.split()[0] for m in messages] == [
        "building", "writing", "reusing", "reusing", "reusing", "writing", "building", "reusing"]
    assert fake_model_builds == [
        {"seed": 0, "init_std": 0.02, "vision_init_std": 0.2, "smooth_coord_embeddings": True},
        {"seed": 0, "init_std": 0.05, "vision_init_std": 0.2, "smooth_coord_embeddings": True},
    ]
    data = tmp_path / "assets" / "data"
    assert len((data / "train.jsonl").read_text().splitlines()) == 5
    assert json.loads((data / ASSET_MANIFEST).read_text())["n_train"] == 5
    for line in (data / "train.jsonl").read_text().splitlines():  # the plan's layout: 1-4 rectangles/triangles
        objects = json.loads(line)["objects"]
        assert 1 <= len(objects) <= 4 and {o["desc"].split()[1] for o in objects} <= {"rectangle", "triangle"}


@pytest.mark.parametrize(("occupy", "key"), [("assets/model/config.json", "model.path"),
                                              ("assets/data/train.jsonl", "data.train_jsonl")])
def test_ensure_assets_refuses_to_overwrite_what_it_did_not_build(tmp_path, fake_model_builds, occupy, key):
    from coordexp.runtime.toy.demo import DemoPlan, ensure_assets
    from coordexp.runtime.train.launch import LaunchError
    from coordexp.schema.contract import load_contract

    stage1, stage2 = _configs(tmp_path)
    if key == "data.train_jsonl":  # get past the model: let the demo build it first
        ensure_assets(load_contract(stage1), DemoPlan(stage1, stage2, n_train=1, n_val=1), lambda _: None)
        (tmp_path / "assets" / "data" / "coordexp-demo-build.json").unlink()
    foreign = tmp_path / occupy
    foreign.parent.mkdir(parents=True, exist_ok=True)
    foreign.write_text("precious\n")
    with pytest.raises(LaunchError, match=f"did not build.*{key}"):
        ensure_assets(load_contract(stage1), DemoPlan(stage1, stage2, n_train=1, n_val=1), lambda _: None)
    assert foreign.read_text() == "precious\n"


def test_ensure_assets_rebuilds_an_unmarked_model_inside_a_coordexp_tree(tmp_path, fake_model_builds):
    """Older demo versions left .coordexp/ assets without a manifest; .coordexp/ is the demo's own scratch space."""
    from coordexp.runtime.toy.demo import DemoPlan, ensure_assets
    from coordexp.schema.contract import load_contract

    stage1, stage2 = _configs(tmp_path)
    data = yaml.safe_load(stage1.read_text())
    data["model"]["path"] = "./.coordexp/tiny-model"
    _write(stage1, data)
    (tmp_path / ".coordexp" / "tiny-model").mkdir(parents=True)
    (tmp_path / ".coordexp" / "tiny-model" / "config.json").write_text("{}")
    messages: list[str] = []
    ensure_assets(load_contract(stage1), DemoPlan(stage1, stage2, n_train=1, n_val=1), messages.append)
    assert messages[0].startswith("building tiny model") and len(fake_model_builds) == 1


def test_demo_rejects_a_stage2_that_does_not_start_from_stage1(tmp_path):
    stage1, stage2 = _configs(tmp_path)
    data = yaml.safe_load(stage2.read_text())
    data["model"]["path"] = "./elsewhere"
    _write(stage2, data)
    result = runner.invoke(app, ["demo", "--quick", "--stage1", str(stage1), "--stage2", str(stage2)])
    assert result.exit_code == 2
    assert "stage 2 must start from stage 1" in result.output


@pytest.mark.slow  # trains both stages twice, in two processes
def test_the_demo_figures_do_not_depend_on_the_machines_thread_count(tmp_path):
    """``--threads`` (default 1) fixes torch's CPU threads for the run: two processes whose torch starts with 1 and
    with 2 threads (``OMP_NUM_THREADS``, as on machines with 1 and 2 cores) print the same figures. Without the pin
    the two differ in the stage-2 loss's last digits, and a longer run trains a different model."""
    import os
    import subprocess
    import sys

    stage1, stage2 = _configs(tmp_path)
    losses = []
    for threads in ("1", "2"):
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        done = subprocess.run([sys.executable, "-m", "coordexp", "demo", "--quick", "--json", "--stage1", str(stage1),
                               "--stage2", str(stage2)], env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout)
        assert summary["threads"] == 1
        losses.append([summary[point]["loss"] for point in ("before_stage2", "after_stage2")])
    assert losses[0] == losses[1]


def test_the_demo_restores_the_callers_thread_count(tmp_path, monkeypatch):
    """An in-process caller (a notebook, this test process) keeps its own torch thread setting after the demo,
    even when the run fails."""
    import torch

    calls = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    stage1, stage2 = _configs(tmp_path)
    (tmp_path / "runs" / "s1").mkdir(parents=True)
    (tmp_path / "runs" / "s1" / "precious.txt").write_text("not the demo's")  # the demo refuses to clear it
    result = runner.invoke(app, ["demo", "--quick", "--threads", "3", "--stage1", str(stage1), "--stage2", str(stage2)])
    assert result.exit_code == 2, result.output
    assert calls == [3, 7]
