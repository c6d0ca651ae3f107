"""The grid task's data (coordexp/runtime/toy/grid.py): one box per occupied cell, inside it, in row-major order,
labels that match the drawn pixels, same arguments -> same bytes."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.toy.grid import GRID_DESC, GridLayout, cell_of, grid_cells, grid_record, write_grid_dataset


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), cells=st.integers(2, 6))
def test_boxes_sit_inside_distinct_cells_in_reading_order(seed, cells):
    layout = GridLayout(cells, 28, 1, cells * cells)
    _, objects = grid_record(random.Random(seed), layout, position_code=0)
    bounds = grid_cells(cells)
    owners = []
    for o in objects:
        x1, y1, x2, y2 = o["bbox_2d"]
        assert o["desc"] == GRID_DESC and x1 < x2 and y1 < y2
        k = cell_of((x1 + x2) / 2, (y1 + y2) / 2, cells)
        cx1, cy1, cx2, cy2 = bounds[k]
        assert cx1 < x1 and x2 < cx2 and cy1 < y1 and y2 < cy2  # a margin to every cell edge
        owners.append(k)
    assert owners == sorted(set(owners))  # one box per cell, row-major
    assert layout.min_objects <= len(objects) <= layout.max_objects


def test_labels_match_the_pixels_and_sizes_vary():
    layout = GridLayout(4, 28, 4, 12)
    image, objects = grid_record(random.Random(7), layout, position_code=0)
    pixels = np.asarray(image)[..., 0]
    background = int(pixels[0, 0]) if not any(o["bbox_2d"][0] < 5 and o["bbox_2d"][1] < 5 for o in objects) else None
    for o in objects:
        x1, y1, x2, y2 = (round(v * 112 / 1000) for v in o["bbox_2d"])
        inner = pixels[y1 + 1:y2 - 1, x1 + 1:x2 - 1]
        assert inner.size and (inner > 200).all()
    if background is not None:
        assert background < 100
    sizes = {(o["bbox_2d"][2] - o["bbox_2d"][0]) for o in objects}
    assert len(sizes) > 1


def test_same_seed_same_bytes(tmp_path):
    layout = GridLayout(4, 28, 4, 12)
    a = write_grid_dataset(tmp_path / "a", n_train=3, n_val=2, seed=1, layout=layout)
    b = write_grid_dataset(tmp_path / "b", n_train=3, n_val=2, seed=1, layout=layout)
    c = write_grid_dataset(tmp_path / "c", n_train=3, n_val=2, seed=2, layout=layout)
    assert a.train_jsonl.read_text() == b.train_jsonl.read_text() != c.train_jsonl.read_text()
    assert (a.image_dir / "val_00001.png").read_bytes() == (b.image_dir / "val_00001.png").read_bytes()
    record = json.loads(a.val_jsonl.read_text().splitlines()[0])
    assert record["width"] == record["height"] == 112 and 4 <= len(record["objects"]) <= 12


def test_layout_refuses_more_objects_than_cells():
    with pytest.raises(ValueError, match="one box per cell"):
        GridLayout(3, 28, 4, 10)
