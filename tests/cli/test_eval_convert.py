"""``coordexp convert`` (round trip, clean failures: exit 2, ``file: record`` text, nothing written) and
``coordexp eval`` on a tiny stage-2 run (prints AP, writes results the COCO library loads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.runtime.model.data import load_records

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def _coco() -> dict:
    return {
        "images": [{"id": 1, "width": 640, "height": 480, "file_name": "one.jpg"},
                   {"id": 2, "width": 300, "height": 200, "file_name": "two.jpg"}],
        "categories": [{"id": 4, "name": "cat"}, {"id": 8, "name": "dog"}],
        "annotations": [
            {"id": 10, "image_id": 1, "category_id": 4, "bbox": [64, 48, 320, 240], "iscrowd": 0,
             "segmentation": [[64, 48, 384, 48, 224, 288]]},
            {"id": 11, "image_id": 2, "category_id": 8, "bbox": [30, 20, 60, 40], "iscrowd": 0, "segmentation": []},
            {"id": 12, "image_id": 2, "category_id": 4, "bbox": [0, 0, 10, 10], "iscrowd": 1,
             "segmentation": {"counts": [0, 100], "size": [200, 300]}},
        ],
    }


def test_to_jsonl_writes_loadable_records_and_reports_skips(tmp_path):
    source = tmp_path / "instances.json"
    source.write_text(json.dumps(_coco()))
    output = tmp_path / "out" / "train.jsonl"
    result = _run("convert", "to-jsonl", source, "-o", output, "--image-prefix", "val2017/", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["images"] == 2 and summary["objects"] == 2 and summary["skipped"] == {}
    assert summary["crowd_regions"] == 1  # kept as an ignore region (issue 55), not an object
    records = load_records(output, tmp_path, check_files=False)
    assert [str(r.image_paths[0].relative_to(tmp_path)) for r in records] == ["val2017/one.jpg", "val2017/two.jpg"]
    assert records[0].objects[0].desc == "cat" and records[0].objects[0].coords == (100, 100, 600, 100, 350, 600)
    assert records[1].objects[0].desc == "dog" and records[1].objects[0].coords == (100, 100, 300, 300)


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (lambda d: d["images"][0].pop("height"), "images[0] (id 1): missing image size"),
        (lambda d: d["annotations"][1].__setitem__("bbox", [250, 20, 60, 40]),
         "annotations[1] (id 11): box [250, 20, 310, 60] (xyxy pixels) lies outside the 300x200 image"),
        (lambda d: d["annotations"][0].__setitem__("category_id", 5), "annotations[0] (id 10): unknown category_id 5"),
    ],
    ids=["missing-size", "box-out-of-range", "unknown-category"],
)
def test_bad_input_exits_2_names_the_record_and_writes_nothing(tmp_path, break_it, expected):
    document = _coco()
    break_it(document)
    source = tmp_path / "instances.json"
    source.write_text(json.dumps(document))
    output = tmp_path / "train.jsonl"
    output.write_text("previous contents\n")
    result = _run("convert", "to-jsonl", source, "-o", output)
    assert result.exit_code == 2
    assert f"{source}: {expected}" in " ".join(result.stderr.split())
    assert output.read_text() == "previous contents\n"  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["instances.json", "train.jsonl"]  # no temp file left


def test_unreadable_json_exits_2(tmp_path):
    source = tmp_path / "instances.json"
    source.write_text("{not json")
    result = _run("convert", "to-jsonl", source, "-o", tmp_path / "x.jsonl")
    assert result.exit_code == 2 and "not valid JSON" in result.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_to_results_maps_predictions_onto_the_original_ids(tmp_path):
    gt = tmp_path / "instances.json"
    gt.write_text(json.dumps(_coco()))
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text(json.dumps({"image": "/data/val2017/two.jpg", "width": 300, "height": 200, "objects": [
        {"desc": "dog", "bbox_2d": [100, 100, 300, 300], "score": 0.8},
        {"desc": "unicorn", "bbox_2d": [0, 0, 5, 5], "score": 0.9}]}) + "\n")
    output = tmp_path / "results.json"
    result = _run("convert", "to-results", predictions, "--gt", gt, "-o", output)
    assert result.exit_code == 0, result.output
    assert "left out: 1" in result.stdout
    from faster_coco_eval import COCO

    loaded = COCO(str(gt)).loadRes(str(output))
    (ann,) = loaded.loadAnns(loaded.getAnnIds())
    assert (ann["image_id"], ann["category_id"], ann["score"]) == (2, 8, 0.8)
    assert ann["bbox"] == pytest.approx([30, 20, 60, 40])


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("eval_run")
    build_tiny_model(root / "model", seed=0)
    write_synthetic_dataset(root / "data", n_train=4, n_val=3, seed=0)
    config = {
        "extends": str(EXAMPLES / "demo_stage2.yaml"),
        "model": {"path": "./model"},
        "data": {"train_jsonl": "./data/train.jsonl", "val_jsonl": "./data/val.jsonl"},
        "training": {"output_dir": "./run", "max_steps": 1, "logging_steps": 1, "per_device_train_batch_size": 2},
        "rollout_matching": {"decode_batch_size": 2, "max_new_tokens": 24},
    }
    path = root / "stage2.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    result = _run("train", path)
    assert result.exit_code == 0, result.output
    return path


def test_eval_prints_ap_and_writes_results(trained_run):
    result = _run("eval", trained_run, "--limit", "2", "--pngs", "1")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "detection quality (2 images" in text and "AP50" in text and "boxes" in text
    assert "parse valid" in text and "match rate" in text
    run_dir = trained_run.parent / "run"
    assert f"model {run_dir}" in text  # the trained output_dir, not the starting model
    metrics = json.loads((run_dir / "eval_val" / "metrics.json").read_text())
    assert metrics["images"] == 2 and 0.0 <= metrics["bbox"]["AP"] <= 1.0
    from faster_coco_eval import COCO

    COCO(str(run_dir / "eval_val" / "coco_gt.json")).loadRes(str(run_dir / "eval_val" / "coco_results.json"))
    assert len(list((run_dir / "eval_val" / "png").glob("*.png"))) == 1


def test_eval_json_and_bad_arguments(trained_run, tmp_path):
    result = _run("eval", trained_run, "--limit", "1", "--json", "--score", "constant", "--out", tmp_path / "e")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["ok"] and payload["images"] == 1 and payload["score"] == "constant" and "AP50" in payload["bbox"]
    assert _run("eval", trained_run, "--split", "test").exit_code == 2
    missing = _run("eval", trained_run, "--checkpoint", tmp_path / "nothing")
    assert missing.exit_code == 2 and "holds no saved model" in missing.stderr


def test_eval_json_carries_the_set_figures(trained_run, tmp_path):
    """Issue 42: precision / recall / F1 (class-aware and any class), predictions per GT, certified duplicates,
    premature EOS and recall by rank in `eval --json`, fractions, consistent with the rollout counters."""
    result = _run("eval", trained_run, "--limit", "3", "--json", "--score", "constant", "--out", tmp_path / "e")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    figures = payload["figures"]
    for key in ("recall", "recall_any_class", "duplicates_per_image", "pred_per_gt", "premature_eos_rate",
                "cut_off_rate", "count_error"):
        assert isinstance(figures[key], float) and figures[key] >= 0.0, key
    assert all(figures[k] is None or 0.0 <= figures[k] <= 1.0 for k in ("precision", "f1", "precision_any_class"))
    records = load_records(trained_run.parent / "data" / "val.jsonl", max_samples=3)
    assert len(figures["recall_by_rank"]) == max(len(r.objects) for r in records)
    measured = json.loads((tmp_path / "e" / "metrics.json").read_text())["measured"]  # issue 55: what was measured
    assert measured == payload["measured"] and measured["images"] == 3 and measured["limit"] == 3
    from coordexp.cli.frame import load_run

    output_dir = Path(load_run(Path(trained_run)).training.output_dir).resolve()
    assert measured["model"]["path"] == str(output_dir) and measured["model"]["step"] is not None
    assert len(measured["model"]["weights_sha256"]) == 64 and measured["decoding"]["temperature"] == 0.0
    buckets = figures["count_buckets"]  # issue 53: recall and premature EOS by ground-truth objects per image
    assert sum(b["images"] for b in buckets.values()) == sum(1 for r in records if r.objects)
    assert sum(b["objects"] for b in buckets.values()) == sum(len(r.objects) for r in records)
    counters = payload["counters"]  # counted by the rollout telemetry, apart from the set figures
    assert figures["pred_per_gt"] == pytest.approx(counters["pred_valid"] / counters["gt_objects"])
    assert figures["cut_off_rate"] == pytest.approx(1 - counters["eos_stopped"] / counters["samples"])
    text = _run("eval", trained_run, "--limit", "3", "--score", "constant", "--out", tmp_path / "t").stdout
    assert "class-aware" in text and "any class" in text and "predictions per GT" in text
    assert "by ground-truth objects per image: 1-6 objects" in " ".join(text.split())


def test_probe_reports_deletion_recovery_and_oracle_k(trained_run, tmp_path):
    result = _run("probe", trained_run, "--limit", "3", "--oracle-k", "2", "--json", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["ok"] and payload["images"] == 3 and payload["oracle_k"] == 2
    assert "deletion_recovery" in payload and "exposure_gap" in payload and "duplicate_probe" in payload
    assert payload["greedy_recall"] <= payload["oracle_k_recall"] <= 1.0  # samples only add found objects
    assert payload["greedy_recall"] == pytest.approx(payload["recall"])  # the same greedy rollouts
    assert (tmp_path / "p" / "probe.json").is_file() and (tmp_path / "p" / "recall_by_rank.png").is_file()
    assert _run("probe", trained_run, "--oracle-k", "-1").exit_code == 2


def test_rollout_log_carries_the_raw_text(trained_run, tmp_path):
    """The logged rollouts keep what the model wrote (not only the parsed prefix) and how many tokens it was."""
    from coordexp.runtime.train.run_log import read_run_log
    from coordexp.runtime.train.visualize import read_rollout_log

    run_dir = trained_run.parent / "run"
    entries = read_rollout_log(run_dir)
    written = [n for r in read_run_log(run_dir, event="rollout") if r["tag"] == "train" for n in r["response_tokens"]]
    assert [e.raw_tokens for e in entries if e.tag == "train"] == written
    assert all(e.raw_text or not e.raw_tokens for e in entries)
    assert any(len(e.raw_text) > len(e.text) for e in entries) or all(e.raw_text.startswith(e.text) for e in entries)
    shown = _run("show-rollouts", run_dir, "--out", tmp_path / "png")
    assert shown.exit_code == 0, shown.output


def test_eval_dedup_reports_removal_beside_the_raw_figures(trained_run, tmp_path):
    result = _run("eval", trained_run, "--limit", "3", "--json", "--dedup", "--out", tmp_path / "d")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    raw, free = payload["dedup"]["raw"], payload["dedup"]["label_free"]
    assert raw["AP50"] == pytest.approx(payload["bbox"]["AP50"])  # the raw figures are the report's own
    assert raw["removed"] == 0 and free["removed"] >= 0
    assert payload["figures"]["precision"] == raw["precision"]
