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
    header = image.size[1] - 400  # the caption band above the picture
    assert image.size[0] == 400 and header > 0
    # Right edges (x = 0.4 * 100 px * 4) of the GT box, its matched prediction (x = 0.38), the FP (x = 0.8) and
    # the FN polygon's right edge (x = 0.9); sample mid-height of each edge, away from labels.
    assert image.getpixel((160, header + 100)) == COLOURS["gt"]
    assert image.getpixel((152, header + 100)) == COLOURS["matched"]
    assert image.getpixel((320, header + 80)) == COLOURS["fp"]
    assert image.getpixel((360, header + 320)) == COLOURS["fn"]
    assert image.getpixel((20, header + 200)) == (255, 255, 255)


def test_ground_truth_is_drawn_when_nothing_matches(tmp_path, white_image):
    from dataclasses import replace

    entry = replace(_entry(white_image), predictions=(), pairs=())
    image = Image.open(render_rollout(entry, tmp_path / "r.png", scale=4)).convert("RGB")
    header = image.size[1] - 400
    assert image.getpixel((160, header + 100)) == COLOURS["fn"]  # the unmatched cat box, as FN


def test_caption_names_image_step_scores_and_raw_text(white_image):
    from dataclasses import replace

    from coordexp.runtime.train.visualize import caption_lines, shown_step

    entry = replace(_entry(white_image), text='{"objects": [' + "x" * 500)
    lines = caption_lines(entry, 60, scores=[0.9, 0.25])
    assert lines[0] == "white.png  train step 8  2 predicted, 2 GT, 1 matched"  # logged at 7: progress's step 8
    assert lines[1] == "scores: 0.90 0.25" and lines[2].startswith('text: {"objects": [')
    assert len(lines) == 2 + 4 and lines[-1].endswith("...")  # the raw text is cut after four lines
    assert shown_step(replace(entry, tag="eval")) == 7  # an evaluation is logged after the steps it evaluates


def test_render_log_writes_one_png_per_entry(tmp_path, white_image):
    append_rollout_log(tmp_path, [_entry(white_image)] * 3)
    paths = render_rollout_log(tmp_path, limit=2)
    assert len(paths) == 2 and all(p.is_file() for p in paths)


def test_png_names_count_steps_from_one(tmp_path, white_image):
    from dataclasses import replace

    append_rollout_log(tmp_path, [replace(_entry(white_image), step=0)])
    assert [p.name for p in render_rollout_log(tmp_path)] == ["train_step000001_00.png"]
