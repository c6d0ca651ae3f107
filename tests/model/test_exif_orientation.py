"""EXIF orientation, one rule everywhere (issue 55, item 1): phone photos store their pixels turned and say so in
EXIF; annotation tools (CVAT, Label Studio) annotate the image as a viewer shows it. Every load applies the
orientation, so the pixels the model sees, the boxes and the sizes are in that frame, and a record whose size is
not the displayed image's is refused naming the record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from coordexp.runtime.model.data import displayed_size, load_records, open_image, upright

STORED = (64, 32)  # width, height of the stored pixels


def _photo(path: Path, orientation: int) -> Path:
    """A JPEG whose stored pixels are 64 x 32 (left half red, right half blue) with the given EXIF orientation."""
    image = Image.new("RGB", STORED, (255, 0, 0))
    image.paste((0, 0, 255), (32, 0, 64, 32))
    exif = Image.Exif()
    exif[0x0112] = orientation
    image.save(path, exif=exif.tobytes(), quality=95)
    return path


@pytest.mark.parametrize(("orientation", "shown"), [(1, (64, 32)), (3, (64, 32)), (6, (32, 64)), (8, (32, 64))])
def test_the_displayed_size_and_pixels_follow_the_exif_orientation(tmp_path, orientation, shown):
    path = _photo(tmp_path / "photo.jpg", orientation)
    with open_image(path) as image:
        assert displayed_size(image) == shown
        turned = upright(image).convert("RGB")
    assert turned.size == shown
    red_at = {1: (2, 16), 3: (61, 16), 6: (16, 2), 8: (16, 61)}[orientation]  # where the stored left half went
    red, _, blue = turned.getpixel(red_at)
    assert red > 200 and blue < 60


def _records(tmp_path: Path, orientation: int, width: int, height: int) -> Path:
    _photo(tmp_path / "photo.jpg", orientation)
    record = {"images": ["photo.jpg"], "width": width, "height": height,
              "objects": [{"desc": "cat", "bbox_2d": [0, 0, 500, 999]}]}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path


def test_a_record_in_the_displayed_frame_loads_and_its_image_is_upright(tmp_path):
    from coordexp.runtime.model.encoding import load_images

    records = load_records(_records(tmp_path, 6, 32, 64), tmp_path)
    assert [im.size for im in load_images(records[0])] == [(32, 64)]


@pytest.mark.parametrize("orientation", [6, 8])
def test_a_record_in_the_stored_frame_of_a_turned_photo_is_named_as_a_mismatch(tmp_path, orientation):
    from coordexp.runtime.model.data import size_mismatch

    (record,) = load_records(_records(tmp_path, orientation, 64, 32), tmp_path)
    text = " ".join(size_mismatch(record.image_paths[0], record.width, record.height).split())
    assert "64 x 32" in text and "32 x 64" in text and "EXIF orientation" in text
    assert size_mismatch(record.image_paths[0], 32, 64) is None


def test_preflight_refuses_a_record_claiming_another_size_than_its_image(tmp_path, tiny_model_dir):
    import yaml
    from typer.testing import CliRunner

    from coordexp.cli.app import app

    train = _records(tmp_path, 1, 640, 480)
    config = tmp_path / "cfg.yaml"
    examples = Path(__file__).resolve().parents[2] / "examples"
    config.write_text(yaml.safe_dump({
        "extends": str(examples / "demo_stage2.yaml"), "custom": {"trainer_variant": "stage1_sft"},
        "model": {"path": str(tiny_model_dir)}, "data": {"train_jsonl": str(train), "val_jsonl": None},
        "training": {"output_dir": str(tmp_path / "run")}}))
    result = CliRunner().invoke(app, ["preflight", str(config)])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "640 x 480" in text and "train.jsonl:1" in text


def test_convert_flags_a_wrong_width_height_and_accepts_the_displayed_one(tmp_path):
    from typer.testing import CliRunner

    from coordexp.cli.app import app

    _photo(tmp_path / "photo.jpg", 6)

    def coco(width: int, height: int) -> Path:
        data = {"images": [{"id": 1, "file_name": "photo.jpg", "width": width, "height": height}],
                "categories": [{"id": 1, "name": "cat"}],
                "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 16, 30], "iscrowd": 0,
                                 "area": 480}]}
        path = tmp_path / f"coco_{width}x{height}.json"
        path.write_text(json.dumps(data))
        return path

    runner = CliRunner()
    wrong = runner.invoke(app, ["convert", "to-jsonl", str(coco(64, 32)), "-o", str(tmp_path / "a.jsonl")])
    assert wrong.exit_code == 2, wrong.output
    assert "photo.jpg" in wrong.output and not (tmp_path / "a.jsonl").exists()
    right = runner.invoke(app, ["convert", "to-jsonl", str(coco(32, 64)), "-o", str(tmp_path / "b.jsonl")])
    assert right.exit_code == 0, right.output


def test_detect_reports_the_displayed_size(tmp_path):
    from coordexp.runtime.server.detect import Detector

    _photo(tmp_path / "photo.jpg", 6)
    detector = Detector.__new__(Detector)
    detector.image_root = tmp_path
    assert detector.image_size("photo.jpg") == (32, 64)
