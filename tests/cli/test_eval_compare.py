"""``coordexp eval --compare A B`` (issue 55, item 4): two eval folders of the same images, B minus A paired by
image with bootstrap intervals and the noise floor; folders of other images are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.runtime.core.coco import CocoImage, ScoredObject, build_coco_gt, coco_results
from coordexp.runtime.core.objects import DetObject


def box(x: int, y: int = 100) -> DetObject:
    return DetObject("cat", "bbox_2d", (x, y, x + 80, y + 80))


GT = [[box(0), box(200), box(400)], [box(0), box(300)], [box(100)], [box(0), box(500), box(700)]]


def _folder(root: Path, found: list[list[int]], *, names: tuple[str, ...] = ("a", "b", "c", "d")) -> Path:
    """An eval folder whose image k holds the ground truth GT[k] and detections of the GT objects listed."""
    images = [CocoImage(k + 1, 1000, 1000, f"{names[k]}.png", tuple(GT[k])) for k in range(len(GT))]
    scored = [ScoredObject(k + 1, GT[k][j], 0.9 - 0.1 * j) for k, picks in enumerate(found) for j in picks]
    scored.append(ScoredObject(1, box(900, 900), 0.3))  # one false positive in both
    results, _ = coco_results(scored, {k + 1: (1000, 1000) for k in range(len(GT))}, {"cat": 1})
    root.mkdir(parents=True)
    (root / "coco_gt.json").write_text(json.dumps(build_coco_gt(images, ["cat"])))
    (root / "coco_results.json").write_text(json.dumps(results))
    return root


def _compare(a: Path, b: Path, *more: str):
    return CliRunner().invoke(app, ["eval", "--compare", str(a), str(b), "--json", *more], catch_exceptions=False)


def test_b_finding_more_objects_is_a_positive_recall_difference_with_its_interval(tmp_path):
    a = _folder(tmp_path / "a", [[0], [0], [], [0]])
    b = _folder(tmp_path / "b", [[0, 1], [0, 1], [0], [0, 1]])
    result = _compare(a, b, "--bootstrap", "200")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    recall = payload["figures"]["recall"]
    assert recall["A"] == pytest.approx(3 / 9) and recall["B"] == pytest.approx(7 / 9)
    assert recall["difference"] == pytest.approx(4 / 9) and recall["ci95"][0] > 0
    assert payload["figures"]["AP50"]["difference"] > 0
    assert payload["one_object_points"] == pytest.approx(100 / 9) and payload["images"] == 4
    same = json.loads(_compare(a, a, "--bootstrap", "100").stdout)["figures"]
    assert all(row["difference"] == 0 and row["ci95"] == [0.0, 0.0] for row in same.values())
    text = CliRunner().invoke(app, ["eval", "--compare", str(a), str(b)], catch_exceptions=False).output
    assert "noise floor: 9 ground-truth objects: one true positive = 11.1 points" in " ".join(text.split())


def test_folders_of_other_images_are_refused(tmp_path):
    a = _folder(tmp_path / "a", [[0], [0], [], [0]])
    b = _folder(tmp_path / "b", [[0], [0], [], [0]], names=("a", "b", "c", "x"))
    result = _compare(a, b)
    assert result.exit_code == 2 and "not of the same images" in " ".join(result.output.split())
    missing = _compare(a, tmp_path / "nothing")
    assert missing.exit_code == 2 and "coco_gt.json is missing" in " ".join(missing.output.split())
    both = CliRunner().invoke(app, ["eval", str(a / "coco_gt.json"), "--compare", str(a), str(a)])
    assert both.exit_code == 2
