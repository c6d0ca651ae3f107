"""COCO / LVIS / ODVG <-> JSONL conversion: bins within one bin of the pixels, crowd/RLE skipped and counted,
every kind of bad input a ``file: record: problem`` error (exit 2) listing all problems."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.errors import EXIT_INVALID, exit_code_for
from coordexp.runtime.core.coco import (
    CocoImage,
    ConversionError,
    ScoredObject,
    bin_to_pixel,
    build_coco_gt,
    coco_results,
    coco_to_records,
    odvg_to_records,
    pixel_to_bin,
    predictions_to_coco_results,
)
from coordexp.runtime.core.objects import DetObject


def hand_written_coco() -> dict:
    """Two images of odd sizes, two categories with non-contiguous ids; a box, a polygon, a two-part polygon,
    a crowd RLE and a polygon crowd."""
    return {
        "images": [
            {"id": 7, "width": 640, "height": 480, "file_name": "a/one.jpg"},
            {"id": 9, "width": 333, "height": 517, "file_name": "two.jpg"},
        ],
        "categories": [{"id": 1, "name": "cat"}, {"id": 3, "name": "dog"}],
        "annotations": [
            {"id": 1, "image_id": 7, "category_id": 1, "bbox": [10.5, 20.25, 100.0, 50.0], "iscrowd": 0,
             "area": 5000.0, "segmentation": []},
            {"id": 2, "image_id": 7, "category_id": 3, "bbox": [300, 200, 100, 120], "iscrowd": 0, "area": 6000.0,
             "segmentation": [[300.0, 200.0, 400.0, 210.5, 350.0, 320.0]]},
            {"id": 3, "image_id": 9, "category_id": 3, "bbox": [0, 0, 333, 517], "iscrowd": 0, "area": 100.0,
             "segmentation": [[0, 0, 10, 0, 10, 10], [200, 200, 250, 200, 250, 260]]},
            {"id": 4, "image_id": 9, "category_id": 1, "bbox": [5, 5, 20, 20], "iscrowd": 1, "area": 400,
             "segmentation": {"counts": [0, 10], "size": [517, 333]}},
            {"id": 5, "image_id": 9, "category_id": 1, "bbox": [40, 40, 20, 20], "iscrowd": 0, "area": 400,
             "segmentation": {"counts": "abc", "size": [517, 333]}},
        ],
    }


def test_convert_maps_geometry_categories_and_counts_skips():
    converted = coco_to_records(hand_written_coco(), source="inst.json", image_prefix="train2017/")
    assert converted.categories == ["cat", "dog"]
    assert converted.skipped == {"rle": 1} and converted.crowd_regions == 1  # crowd: an ignore region (issue 55)
    assert converted.as_box == {"multipart_polygon": 1}
    first, second = converted.records
    assert first["images"] == ["train2017/a/one.jpg"] and (first["width"], first["height"]) == (640, 480)
    assert first["coco_image_id"] == 7
    assert first["objects"][0] == {"desc": "cat", "bbox_2d": [16, 42, 173, 146]}  # 10.5/640*1000 = 16.4 -> 16
    assert first["objects"][1]["desc"] == "dog" and len(first["objects"][1]["poly"]) == 6
    # the two-part polygon falls back to its box, which spans the whole image: the right/bottom edge clamps to 999
    assert second["objects"] == [{"desc": "dog", "bbox_2d": [0, 0, 999, 999]}]


def _pixel_points(ann: dict) -> list[float]:
    if ann["segmentation"] and isinstance(ann["segmentation"], list) and len(ann["segmentation"]) == 1:
        return ann["segmentation"][0]
    x, y, w, h = ann["bbox"]
    return [x, y, x + w, y + h]


def test_round_trip_is_within_one_bin():
    source = hand_written_coco()
    converted = coco_to_records(source, source="inst.json")
    images = [
        CocoImage(r["coco_image_id"], r["width"], r["height"], r["images"][0],
                  tuple(DetObject(o["desc"], "bbox_2d" if "bbox_2d" in o else "poly",
                                  tuple(o.get("bbox_2d") or o["poly"])) for o in r["objects"]))
        for r in converted.records
    ]
    back = build_coco_gt(images, converted.categories)
    assert [c["name"] for c in back["categories"]] == ["cat", "dog"]
    originals = [a for a in source["annotations"] if not a["iscrowd"] and isinstance(a["segmentation"], list)]
    assert len(back["annotations"]) == len(originals)
    sizes = {img["id"]: (img["width"], img["height"]) for img in source["images"]}
    for original, restored in zip(originals, back["annotations"]):
        width, height = sizes[original["image_id"]]
        assert restored["image_id"] == original["image_id"]
        assert back["categories"][restored["category_id"] - 1]["name"] == (
            "cat" if original["category_id"] == 1 else "dog")
        expected = _pixel_points(original)
        if len(expected) == 4:  # a box: compare [x, y, w, h] corners
            x, y, w, h = restored["bbox"]
            got = [x, y, x + w, y + h]
        else:
            got = restored["segmentation"][0]
        for k, (a, b) in enumerate(zip(expected, got, strict=True)):
            bin_px = (width if k % 2 == 0 else height) / 1000
            assert abs(a - b) <= bin_px + 1e-9, (original["id"], k, a, b)


@given(size=st.integers(1, 20000), fraction=st.floats(0, 1))
def test_pixel_bin_round_trip_moves_at_most_one_bin(size, fraction):
    pixel = fraction * size
    assert 0 <= pixel_to_bin(pixel, size) <= 999
    assert abs(bin_to_pixel(pixel_to_bin(pixel, size), size) - pixel) <= size / 1000 * (1 + 1e-9)


@given(size=st.integers(1, 20000), bin_index=st.integers(0, 999))
def test_bin_pixel_bin_is_identity(size, bin_index):
    assert pixel_to_bin(bin_to_pixel(bin_index, size), size) == bin_index


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_boxes_inside_the_image_convert_and_outside_ones_fail(data):
    width, height = data.draw(st.integers(10, 4000)), data.draw(st.integers(10, 4000))
    x1 = data.draw(st.floats(0, width)); y1 = data.draw(st.floats(0, height))
    w = data.draw(st.floats(0, width - x1)); h = data.draw(st.floats(0, height - y1))
    doc = {"images": [{"id": 1, "width": width, "height": height, "file_name": "x.png"}],
           "categories": [{"id": 1, "name": "thing"}],
           "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [x1, y1, w, h], "iscrowd": 0}]}
    box = coco_to_records(doc, source="s.json").records[0]["objects"][0]["bbox_2d"]
    assert box[0] <= box[2] and box[1] <= box[3]
    for k, value in enumerate((x1, y1, x1 + w, y1 + h)):
        size = width if k % 2 == 0 else height
        assert abs(bin_to_pixel(box[k], size) - value) <= size / 1000 * (1 + 1e-9)
    doc["annotations"][0]["bbox"] = [x1, y1, width - x1 + 2.5, h]  # 2.5 px past the right border
    with pytest.raises(ConversionError):
        coco_to_records(doc, source="s.json")


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (lambda d: d["images"][1].pop("width"), "inst.json: images[1] (id 9): missing image size"),
        (lambda d: d["annotations"][1].__setitem__("bbox", [600, 200, 100, 120]) or
            d["annotations"][1].__setitem__("segmentation", []),
         "inst.json: annotations[1] (id 2): box [600, 200, 700, 320] (xyxy pixels) lies outside the 640x480 image"),
        (lambda d: d["annotations"][0].__setitem__("category_id", 2),
         "inst.json: annotations[0] (id 1): unknown category_id 2"),
        (lambda d: d["annotations"][1]["segmentation"][0].__setitem__(0, -40.0),
         "inst.json: annotations[1] (id 2): polygon leaves the 640x480 image"),
        (lambda d: d["annotations"][0].__setitem__("image_id", 99), "image_id 99 is not in \"images\""),
    ],
    ids=["missing-size", "box-out-of-range", "unknown-category", "polygon-out-of-range", "unknown-image"],
)
def test_bad_input_names_file_and_record(break_it, expected):
    doc = copy.deepcopy(hand_written_coco())
    break_it(doc)
    with pytest.raises(ConversionError) as caught:
        coco_to_records(doc, source="inst.json")
    assert expected in str(caught.value)
    assert exit_code_for(caught.value) == EXIT_INVALID


def test_all_problems_are_listed_not_only_the_first():
    doc = copy.deepcopy(hand_written_coco())
    doc["annotations"][0]["category_id"] = 5
    doc["annotations"][1]["category_id"] = 6
    with pytest.raises(ConversionError) as caught:
        coco_to_records(doc, source="inst.json")
    assert caught.value.problems == (
        "inst.json: annotations[0] (id 1): unknown category_id 5 (not in \"categories\")",
        "inst.json: annotations[1] (id 2): unknown category_id 6 (not in \"categories\")",
    )


def test_lvis_images_without_file_name_use_the_url_name():
    doc = hand_written_coco()
    del doc["images"][0]["file_name"]
    doc["images"][0]["coco_url"] = "http://images.cocodataset.org/train2017/000000000139.jpg"
    assert coco_to_records(doc, source="lvis.json").records[0]["images"] == ["000000000139.jpg"]


def test_geometry_bbox_writes_polygons_as_their_boxes():
    records = coco_to_records(hand_written_coco(), source="i.json", geometry="bbox").records
    assert all("bbox_2d" in o for r in records for o in r["objects"])


def test_odvg_lines_convert_and_unknown_labels_fail():
    good = {"filename": "p.jpg", "width": 200, "height": 100,
            "detection": {"instances": [{"bbox": [20, 10, 120, 60], "label": 0, "category": "person"},
                                        {"bbox": [0, 0, 10, 10], "label": 4}]}}
    grounding = {"filename": "g.jpg", "width": 10, "height": 10, "grounding": {"caption": "x"}}
    lines = [json.dumps(good), "", json.dumps(grounding)]
    converted = odvg_to_records(lines, source="d.jsonl", label_map={4: "car"})
    assert converted.records[0]["objects"] == [{"desc": "person", "bbox_2d": [100, 100, 600, 600]},
                                               {"desc": "car", "bbox_2d": [0, 0, 50, 100]}]
    assert converted.skipped == {"no_detection_block": 1} and converted.categories == ["person", "car"]
    with pytest.raises(ConversionError, match=r"d.jsonl: line 1 instances\[1\]: unknown category"):
        odvg_to_records(lines, source="d.jsonl")


def test_results_are_pixel_boxes_with_scores_and_unknown_descs_are_counted():
    preds = [ScoredObject(3, DetObject("cat", "bbox_2d", (100, 200, 300, 400)), 0.7),
             ScoredObject(3, DetObject("zebra", "bbox_2d", (0, 0, 10, 10)), 0.9)]
    results, left_out = coco_results(preds, {3: (640, 480)}, {"cat": 1})
    assert left_out == {"unknown_category": 1}
    assert results == [{"image_id": 3, "category_id": 1, "bbox": [64.0, 96.0, 128.0, 96.0],
                        "segmentation": [[64.0, 96.0, 192.0, 96.0, 192.0, 192.0, 64.0, 192.0]], "score": 0.7}]


def test_predictions_file_maps_onto_the_original_ids():
    gt = hand_written_coco()
    line = json.dumps({"image": "/data/coco/a/one.jpg", "width": 640, "height": 480,
                       "objects": [{"desc": "dog", "bbox_2d": [0, 0, 500, 500], "score": 0.5}]})
    results, _ = predictions_to_coco_results([line], gt, source="p.jsonl")
    assert results[0]["image_id"] == 7 and results[0]["category_id"] == 3
    assert results[0]["bbox"] == [0.0, 0.0, 320.0, 240.0]
    with pytest.raises(ConversionError, match="p.jsonl: line 1: image '/x/three.jpg' matches no file_name"):
        predictions_to_coco_results([json.dumps({"image": "/x/three.jpg", "objects": []})], gt, source="p.jsonl")
