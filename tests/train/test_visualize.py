"""Rollout logs round-trip and render GT / matched / FP / FN in their colours at the right pixels."""

from __future__ import annotations

import pytest
from PIL import Image

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.train.visualize import (
    COLOURS,
    RolloutLogEntry,
    append_rollout_log,
    read_rollout_log,
    render_rollout,
    render_rollout_log,
)


@pytest.fixture()
def white_image(tmp_path):
    path = tmp_path / "white.png"
    Image.new("RGB", (100, 100), (255, 255, 255)).save(path)
    return path


def _entry(image) -> RolloutLogEntry:
    gt = (
        DetObject("cat", "bbox_2d", (100, 100, 400, 400)),
        DetObject("sign", "poly", (600, 600, 900, 600, 900, 900)),
    )
    preds = (DetObject("cat", "bbox_2d", (120, 120, 380, 380)), DetObject("ghost", "bbox_2d", (500, 100, 800, 300)))
    return RolloutLogEntry(step=7, image=str(image), gt=gt, predictions=preds, pairs=((0, 0),), text="{...}")


def test_fp_and_fn_are_derived_from_pairs(white_image):
    entry = _entry(white_image)
    assert entry.fp_indices == (1,)
    assert entry.fn_indices == (1,)


def test_log_round_trip(tmp_path, white_image):
    entry = _entry(white_image)
    append_rollout_log(tmp_path, [entry, entry])
    assert read_rollout_log(tmp_path) == [entry, entry]


def test_broken_log_line_names_its_line(tmp_path, white_image):
    append_rollout_log(tmp_path, [_entry(white_image)])
    with (tmp_path / "rollouts.jsonl").open("a") as handle:
        handle.write('{"step": 1}\n')
    with pytest.raises(ValueError, match=r"rollouts.jsonl:2"):
        read_rollout_log(tmp_path)


def test_missing_log_is_actionable(tmp_path):
    with pytest.raises(FileNotFoundError, match="output_dir"):
        read_rollout_log(tmp_path)


def test_render_draws_each_kind_in_its_colour(tmp_path, white_image):
    out = render_rollout(_entry(white_image), tmp_path / "r.png", scale=4)
    image = Image.open(out).convert("RGB")
    assert image.size == (400, 400)
    # Right edges (x = 0.4 * 100 px * 4) of the GT box, its matched prediction (x = 0.38), the FP (x = 0.8) and
    # the FN polygon's right edge (x = 0.9); sample mid-height of each edge, away from labels.
    assert image.getpixel((160, 100)) == COLOURS["gt"]
    assert image.getpixel((152, 100)) == COLOURS["matched"]
    assert image.getpixel((320, 80)) == COLOURS["fp"]
    assert image.getpixel((360, 320)) == COLOURS["fn"]
    assert image.getpixel((20, 200)) == (255, 255, 255)


def test_render_log_writes_one_png_per_entry(tmp_path, white_image):
    append_rollout_log(tmp_path, [_entry(white_image)] * 3)
    paths = render_rollout_log(tmp_path, limit=2)
    assert len(paths) == 2 and all(p.is_file() for p in paths)
