"""benchmarks/bench_learning.py stays runnable: a tiny budget end to end over two seeds (per seed: stage 1, then
stage 2, the rollout-only stage 2, stage 1 continued and a --variant, all from that seed's stage-1 checkpoint), one
consistent JSON summary whose spread is computed from the per-seed rows. Its numbers are never asserted."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_learning_benchmark_reports_every_run_of_every_seed_from_one_checkpoint(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), "--workdir", str(tmp_path),
         "--seed", "5", "--n-seeds", "2", "--stage1-steps", "2", "--k", "1", "--n-train", "8", "--n-val", "2",
         "--max-new-tokens", "24", "--score", "constant",
         "--variant", "no_fn_desc=rollout_matching.pipeline.objective.0.config.rollout_fn_desc_weight:0"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("JSON ")]
    assert len(lines) == 1, out.stdout[-3000:]
    result = json.loads(lines[0][len("JSON "):])
    names = ["stage1", "stage2", "stage2_rollout_only", "stage1_continued", "no_fn_desc"]
    assert [s["seed"] for s in result["seeds"]] == [5, 6]
    for seed in result["seeds"]:
        runs = seed["runs"]
        assert list(runs) == names
        assert [runs[name]["train"]["steps"] for name in names] == [2, 1, 1, 1, 1]
        for figures in runs.values():
            assert figures["train"]["trained_tokens"] > 0 and figures["train"]["wall_s"] > 0
            ev = figures["eval"]
            assert ev["gt_objects"] > 0 and all(0.0 <= ev[k] <= 1.0 for k in ("AP", "AP50", "AR100"))
        work = tmp_path / f"seed{seed['seed']}"
        for name in names[1:]:  # every continuation started from this seed's stage-1 checkpoint
            config = yaml.safe_load((work / f"{name}.yaml").read_text())
            assert config["model"]["path"] == str(work / "stage1") and config["training"]["seed"] == seed["seed"]
        assert yaml.safe_load((work / "stage2_rollout_only.yaml").read_text())["rollout_matching"]["gt_step_share"] == 0
        variant = yaml.safe_load((work / "no_fn_desc.yaml").read_text())["rollout_matching"]["pipeline"]["objective"]
        assert variant[0]["config"]["rollout_fn_desc_weight"] == 0 and variant[1]["name"] == "coord_reg"
    ap50 = [s["runs"]["stage2"]["eval"]["AP50"] for s in result["seeds"]]
    assert result["summary"]["stage2"]["AP50"]["mean"] == pytest.approx(statistics.fmean(ap50))
    paired = [s["runs"]["stage2"]["eval"]["AP50"] - s["runs"]["stage1_continued"]["eval"]["AP50"] for s in result["seeds"]]
    assert result["summary"]["stage2 - stage1_continued"]["AP50"]["mean"] == pytest.approx(statistics.fmean(paired))
    assert (tmp_path / "seed5" / "eval_stage2" / "coco_results.json").is_file()

    # --add-arms: one more arm on every seed of the finished run, from the saved stage-1 checkpoints; the run's
    # other arms stay as they were, and options that differ from the run's are refused
    base = ["--workdir", str(tmp_path), "--stage1-steps", "2", "--k", "1", "--n-train", "8", "--n-val", "2",
            "--max-new-tokens", "24", "--score", "constant", "--add-arms"]
    added = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), *base,
         "--variant", "late=rollout_matching.gt_step_share:0.25"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert added.returncode == 0, added.stderr[-3000:]
    grown = json.loads(next(line for line in added.stdout.splitlines() if line.startswith("JSON "))[len("JSON "):])
    for before, after in zip(result["seeds"], grown["seeds"]):
        assert list(after["runs"]) == names + ["late"]
        assert {n: after["runs"][n] for n in names} == before["runs"]
        config = yaml.safe_load((tmp_path / f"seed{after['seed']}" / "late.yaml").read_text())
        assert config["model"]["path"] == str(tmp_path / f"seed{after['seed']}" / "stage1")
        assert config["rollout_matching"]["gt_step_share"] == 0.25
    assert "late - stage1_continued" in grown["summary"]
    assert json.loads((tmp_path / "summary.json").read_text())["seeds"] == grown["seeds"]
    refused = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), *base, "--k", "2",
         "--variant", "other=rollout_matching.gt_step_share:0.5"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert refused.returncode != 0 and "k 2 != 1" in refused.stderr

    # --report over several runs: one seed each, summarized as one run, gives the two-seed run's summary
    for seed in grown["seeds"]:
        single = {**grown, "seeds": [seed]}
        (tmp_path / f"one{seed['seed']}.json").write_text(json.dumps(single))
    merged_dir = tmp_path / "merged"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), "--workdir", str(merged_dir),
         "--report", str(tmp_path / "one5.json"), str(tmp_path / "one6.json")],
        capture_output=True, text=True, timeout=900, cwd=ROOT, check=True,
    )
    merged = json.loads((merged_dir / "summary.json").read_text())
    assert merged["seeds"] == grown["seeds"] and merged["summary"] == grown["summary"]
    twice = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), "--workdir", str(merged_dir),
         "--report", str(tmp_path / "one5.json"), str(tmp_path / "one5.json")],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert twice.returncode != 0 and "a seed appears twice" in twice.stderr

    # --passed-gate-only: a seed whose stage 1 failed the pilot gate is left out and named
    for seed, passed in ((5, True), (6, False)):
        one = json.loads((tmp_path / f"one{seed}.json").read_text())
        one["seeds"][0]["gate"] = {"passed": passed}
        (tmp_path / f"gated{seed}.json").write_text(json.dumps(one))
    gated = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), "--workdir", str(tmp_path / "gated"),
         "--report", str(tmp_path / "gated5.json"), str(tmp_path / "gated6.json"), "--passed-gate-only"],
        capture_output=True, text=True, timeout=900, cwd=ROOT, check=True,
    )
    assert "left out: [6]" in gated.stdout
    kept = json.loads((tmp_path / "gated" / "summary.json").read_text())
    assert [s["seed"] for s in kept["seeds"]] == [5] and kept["left_out_by_gate"] == [6]
    assert kept["summary"]["stage2"]["AP50"]["mean"] == grown["seeds"][0]["runs"]["stage2"]["eval"]["AP50"]
    ungated = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), "--workdir", str(tmp_path / "gated"),
         "--report", str(tmp_path / "one5.json"), "--passed-gate-only"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert ungated.returncode != 0 and "no pilot gate" in ungated.stderr


@pytest.mark.slow
def test_tune_decoding_reports_every_arm_at_its_setting_chosen_on_held_out_images(tmp_path):
    """Issue 53: --tune-decoding N decodes a tuning split apart from the test images at each repetition penalty,
    and every arm (stage 1 included) carries its tuned figures beside the default decoding's, with recall and
    premature EOS per object count; --report prints them, names stage2_shipped and applies the rule's part."""
    bench = str(ROOT / "benchmarks" / "bench_learning.py")
    out = subprocess.run(
        [sys.executable, bench, "--task", "grid", "--workdir", str(tmp_path), "--seed", "7", "--n-seeds", "1",
         "--stage1-steps", "2", "--k", "1", "--n-train", "8", "--n-val", "2", "--max-new-tokens", "24",
         "--probe-images", "1", "--grid-arms", "stage2_recipe", "--score", "constant", "--tune-decoding", "2"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("JSON "))[len("JSON "):])
    seed = result["seeds"][0]
    assert seed["tuning_split"] == {"jsonl": str(tmp_path / "seed7" / "tune_data" / "val.jsonl"), "images": 2,
                                    "seed": -8}
    assert list(seed["runs"]) == ["stage1", "stage1_continued", "stage2_recipe"]
    for name, run in seed["runs"].items():
        tuned = run["tuned"]
        assert [(r["repetition_penalty"], r["near_repeat_removal"]) for r in tuned["tuning"]] == [
            (p, removal) for p in (1.0, 1.05, 1.1) for removal in (False, True)]
        assert tuned["test_decoded_again"] == (tuned["repetition_penalty"] != 1.0)
        for key in ("AP50", "f1", "recall", "precision", "duplicates_per_image", "premature_eos_rate"):
            assert key in tuned and key in tuned["tuning"][0]
        assert set(tuned["count_buckets"]) == set(run["eval"]["count_buckets"]) == {"1-6", "7-10", "11+"}
        if (tuned["repetition_penalty"], tuned["near_repeat_removal"]) == (1.0, False):
            assert tuned["AP50"] == run["eval"]["AP50"]  # the default decoding: the test figures themselves
        for p in (1.0, 1.05, 1.1):  # each penalty decoded the tuning split's images, not the test images
            lines = (tmp_path / "seed7" / f"tune_{name}" / f"rp{p:g}" / "predictions.jsonl").read_text().splitlines()
            assert [json.loads(line)["image"] for line in lines] == [
                str(tmp_path / "seed7" / "tune_data" / "images" / f"val_{k:05d}.png") for k in range(2)]
    config = yaml.safe_load((tmp_path / "seed7" / "eval_tune_rp1.05.yaml").read_text())
    assert config["rollout_matching"]["decoding"]["repetition_penalty"] == 1.05
    assert config["data"]["val_jsonl"] == seed["tuning_split"]["jsonl"]
    summary = result["summary"]
    assert summary["aliases"] == {"stage2_shipped": "stage2_recipe"}
    assert set(summary["tuned"]["arms"]) == set(seed["runs"]) and "stage2_recipe - stage1" in summary["tuned"]["paired"]
    assert summary["beats_detector"]["setting"] == "default" and summary["beats_detector"]["needs_seeds"] == 8
    report = subprocess.run([sys.executable, bench, "--report", str(tmp_path / "summary.json")],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, check=True).stdout
    assert "tuned decoding (chosen per arm" in report and "stage2_shipped: stage2_recipe" in report
    assert "1-6 objects" in report and "issue 53's rule, the default setting's part" in report
