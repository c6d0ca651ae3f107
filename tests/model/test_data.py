"""JSONL record loading: accepted coordinate forms, path resolution, and ``file:line: field`` errors."""

from __future__ import annotations

import json
import re

import pytest

from coordexp.runtime.model.data import MAX_REPORTED_ERRORS, DatasetError, load_records
from coordexp.runtime.core.objects import DetObject


def _png(path, size=(8, 8)):
    """A real (tiny) PNG: the loader reads every image header."""
    from PIL import Image

    Image.new("RGB", size).save(path)
    return path


def _write(tmp_path, records, name="train.jsonl", image="img.png"):
    _png(tmp_path / image)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _record(objects, image="img.png", **extra):
    return {"images": [image], "width": 640, "height": 480, "objects": objects, **extra}


def test_accepts_ints_coord_tokens_flat_and_paired_polygons(tmp_path):
    path = _write(tmp_path, [
        _record([
            {"desc": "cat", "bbox_2d": [10, 20, 30, 40]},
            {"desc": " sign ", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_1|>", "<|coord_999|>"]},
            {"desc": "roof", "poly": [0, 0, 10, 0, 10, 10]},
            {"desc": "kite", "poly": [["<|coord_5|>", 6], [7, 8], [9, "<|coord_10|>"]]},
        ], id="meta is ignored"),
        "",
        _record([]),
    ])
    first, second = load_records(path)
    assert first.objects == (
        DetObject("cat", "bbox_2d", (10, 20, 30, 40)),
        DetObject("sign", "bbox_2d", (1, 2, 1, 999)),  # equal x1 == x2 allowed (decision 3)
        DetObject("roof", "poly", (0, 0, 10, 0, 10, 10)),
        DetObject("kite", "poly", (5, 6, 7, 8, 9, 10)),
    )
    assert (first.width, first.height) == (640, 480)
    assert first.image_paths == (tmp_path / "img.png",)
    assert first.source == f"{path}:1"
    assert second.objects == () and second.source == f"{path}:3"  # blank line 2 skipped, numbering kept


def test_image_root_and_max_samples(tmp_path):
    images = tmp_path / "pics"
    images.mkdir()
    _png(images / "a.png")
    path = tmp_path / "data" / "train.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(json.dumps(_record([], image="a.png")) for _ in range(3)) + "\n{broken\n")
    records = load_records(path, images, max_samples=2)  # the broken line 4 is never read
    assert len(records) == 2 and records[0].image_paths == (images / "a.png",)
    with pytest.raises(DatasetError, match="image file not found: .*data/a.png"):
        load_records(path, max_samples=1)


@pytest.mark.parametrize(
    ("objects", "expected"),
    [
        ([{"desc": "a", "bbox_2d": [1, 2, 3, 4]}, {"desc": "b", "bbox_2d": [1, 2, 3, 4]},
          {"desc": "c", "bbox_2d": [20, 5, 10, 9]}], "objects[2].bbox_2d: x2 (10) < x1 (20)"),
        ([{"desc": "a", "bbox_2d": [1, 9, 3, 4]}], "objects[0].bbox_2d: y2 (4) < y1 (9)"),
        ([{"desc": "a", "bbox_2d": [1, 2, 3]}], "objects[0].bbox_2d: expected a list of 4 coordinates"),
        ([{"desc": "a", "bbox_2d": [1, 2, 1000, 4]}], "objects[0].bbox_2d[2]: 1000 is outside 0..999"),
        ([{"desc": "a", "bbox_2d": [1, 2.5, 3, 4]}], r"objects\[0\].bbox_2d\[1\]: 2.5 is not an integer .*round"),
        ([{"desc": "a", "bbox_2d": [1, True, 3, 4]}], r"bbox_2d\[1\]: True is not an integer"),
        ([{"desc": "a", "bbox_2d": ["<|coord_1000|>", 2, 3, 4]}], r"bbox_2d\[0\]: '<\|coord_1000\|>' is not a coord"),
        ([{"desc": "a", "poly": [1, 2, 3, 4, 5]}], "objects[0].poly: has an odd number of values (5)"),
        ([{"desc": "a", "poly": [1, 2, 3, 4]}], "objects[0].poly: has 2 point(s); a polygon needs at least 3"),
        ([{"desc": "a", "poly": [[1, 2], [3, 4, 5], [6, 7]]}], "objects[0].poly[1]: a point must be [x, y]"),
        ([{"desc": "a", "poly": [[1, 2], 3, 4, [5, 6]]}], "objects[0].poly: mixes [x, y] pairs and bare numbers"),
        ([{"desc": "", "bbox_2d": [1, 2, 3, 4]}], "objects[0].desc: expected a non-empty string"),
        ([{"desc": "a"}], 'objects[0]: has neither of "bbox_2d" and "poly"'),
        ([{"desc": "a", "bbox_2d": [1, 2, 3, 4], "poly": [1, 2, 3, 4, 5, 6]}], "objects[0]: has both"),
        ([{"desc": "a", "bbox": [1, 2, 3, 4]}], r"objects\[0\]: unknown key\(s\) \['bbox'\]"),
        (["cat"], "objects[0]: expected an object"),
    ],
)
def test_object_errors_name_file_line_and_field(tmp_path, objects, expected):
    path = _write(tmp_path, [_record([]), _record(objects)])
    with pytest.raises(DatasetError) as info:
        load_records(path)
    message = str(info.value)
    assert message.startswith("dataset problem:")
    assert f"{path}:2: " in message
    regex = "\\" in expected or ".*" in expected  # regex entries carry escapes or wildcards; others are literal
    assert re.search(expected if regex else re.escape(f"{path}:2: {expected}"), message), message


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a record must be a JSON object"),
        (json.dumps({"images": [], "width": 1, "height": 1, "objects": []}), "images: expected a non-empty list"),
        (json.dumps({"images": ["img.png"], "width": 0, "height": 1, "objects": []}), "width: expected a positive"),
        (json.dumps({"images": ["img.png"], "width": 5, "height": "4", "objects": []}), "height: expected a pos"),
        (json.dumps({"images": ["img.png"], "width": 5, "height": 4}), "objects: expected a list"),
        (json.dumps({"images": ["missing.png"], "width": 5, "height": 4, "objects": []}),
         "images[0]: image file not found: "),
    ],
)
def test_record_errors(tmp_path, line, expected):
    path = _write(tmp_path, [line])
    with pytest.raises(DatasetError) as info:
        load_records(path)
    assert f"{path}:1: {expected}" in str(info.value)


def test_missing_image_names_the_resolved_path_and_the_fix(tmp_path):
    path = _write(tmp_path, [_record([], image="sub/../nope.png")])
    with pytest.raises(DatasetError) as info:
        load_records(path)
    message = str(info.value)
    assert str((tmp_path / "nope.png").resolve()) in message
    assert "set data.image_root" in message


def test_collects_several_errors_then_counts_the_rest(tmp_path):
    bad = _record([{"desc": "x", "bbox_2d": [5, 5, 1, 1]}])
    path = _write(tmp_path, [_record([])] + [bad] * (MAX_REPORTED_ERRORS + 3))
    with pytest.raises(DatasetError) as info:
        load_records(path)
    error = info.value
    assert len(error.problems) == MAX_REPORTED_ERRORS
    assert error.problems[0].startswith(f"{path}:2: objects[0].bbox_2d: x2 (1) < x1 (5)")
    assert error.problems[-1].startswith(f"{path}:{MAX_REPORTED_ERRORS + 1}: ")
    assert str(error).startswith(f"{MAX_REPORTED_ERRORS + 3} problem(s) in the dataset:")
    assert str(error).endswith("... and 3 more")


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_records(tmp_path / "absent.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match="contains no records"):
        load_records(empty)
    path = _write(tmp_path, [_record([])])
    with pytest.raises(DatasetError, match="image_root .* is not a directory"):
        load_records(path, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="max_samples must be >= 1"):
        load_records(path, max_samples=0)


def test_loads_the_synthetic_dataset(synthetic_dataset):
    train = load_records(synthetic_dataset.train_jsonl)
    assert len(train) == 12
    assert all(r.image_paths[0].is_file() for r in train)
    assert any(o.geometry == "poly" for r in train for o in r.objects)
    assert any(o.geometry == "bbox_2d" for r in train for o in r.objects)
