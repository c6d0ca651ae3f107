"""The synthetic dataset is deterministic and its labels match the drawn pixels."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from coordexp.runtime.model.data import load_records
from coordexp.runtime.core.matching import rasterize
from coordexp.runtime.toy.synthetic import COLOURS, write_synthetic_dataset


def _digest(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = write_synthetic_dataset(tmp_path / "a", n_train=6, n_val=2, seed=3)
    b = write_synthetic_dataset(tmp_path / "b", n_train=6, n_val=2, seed=3)
    c = write_synthetic_dataset(tmp_path / "c", n_train=6, n_val=2, seed=4)
    assert _digest(a.root) == _digest(b.root)
    assert len(_digest(a.root)) == 6 + 2 + 2
    assert a.train_jsonl.read_text() != c.train_jsonl.read_text()
    grown = write_synthetic_dataset(tmp_path / "d", n_train=9, n_val=2, seed=3)  # images depend on their index only
    assert (grown.image_dir / "train_00005.png").read_bytes() == (a.image_dir / "train_00005.png").read_bytes()


def test_records_have_the_documented_shape(synthetic_dataset):
    lines = synthetic_dataset.train_jsonl.read_text().splitlines()
    assert len(lines) == 12
    counts = []
    for line in lines:
        record = json.loads(line)
        assert set(record) == {"images", "width", "height", "objects"}
        assert record["images"][0].startswith("images/") and (record["width"], record["height"]) == (112, 112)
        counts.append(len(record["objects"]))
        for obj in record["objects"]:
            colour, shape = obj["desc"].split()
            assert colour in COLOURS and shape in {"rectangle", "triangle", "pentagon", "hexagon"}
            key = "bbox_2d" if shape == "rectangle" else "poly"
            assert set(obj) == {"desc", key}
            values = obj[key]
            assert all(isinstance(v, int) and 0 <= v <= 999 for v in values)
            if key == "poly":
                assert len(values) == 2 * {"triangle": 3, "pentagon": 5, "hexagon": 6}[shape]
                ys = values[1::2]
                assert ys[0] == min(ys)  # canonical start: top-most vertex
    assert all(0 <= n <= 8 for n in counts)


@pytest.mark.parametrize("seed", [0, 1])
def test_labels_match_the_drawn_pixels(tmp_path, seed):
    from PIL import Image

    dataset = write_synthetic_dataset(tmp_path, n_train=10, n_val=0, seed=seed, image_size=(112, 112))
    checked = 0
    for record in load_records(dataset.train_jsonl):
        pixels = np.asarray(Image.open(record.image_paths[0]).convert("RGB"))
        background = pixels[0, 0]
        painted = np.any(pixels != background, axis=-1)
        union = np.zeros_like(painted)
        for obj in record.objects:
            colour = np.array(COLOURS[obj.desc.split()[0]])
            # the label, rasterised at image resolution with the matching convention (pixel centres, v * W / 1000)
            mask = rasterize([obj], 112)[0].astype(bool)
            assert mask.shape == (112, 112)
            union |= mask
            drawn = np.all(pixels == colour, axis=-1)
            if obj.geometry == "bbox_2d":
                x1, y1, x2, y2 = obj.coords
                cy, cx = int((y1 + y2) / 2 * 112 / 1000), int((x1 + x2) / 2 * 112 / 1000)
                assert tuple(pixels[cy, cx]) == tuple(colour)  # the centre of a rectangle has its colour
                assert np.array_equal(drawn & mask, mask)  # exactly the label's pixels are painted
            else:
                centre = obj.points().mean(axis=0) * 112 / 1000
                assert tuple(pixels[int(centre[1]), int(centre[0])]) == tuple(colour)
                # polygons are filled by pixel-centre inclusion (float maths), the raster convention of the labels
                # (integer maths in matching.rasterize): the drawn pixels are exactly the label's raster
                differ = int((drawn & _region_of(mask) ^ mask).sum())
                assert differ == 0, f"{record.source} {obj.desc}: {differ} pixels differ from the label"
            checked += 1
        assert not (painted & ~union).any(), f"{record.source}: painted pixels that belong to no label"
    assert checked >= 10


def _region_of(mask):
    """The label's bounding region grown by 2 pixels: where its own drawn pixels may lie (shapes never share it)."""
    rows, cols = np.nonzero(mask)
    region = np.zeros_like(mask)
    region[max(rows.min() - 2, 0): rows.max() + 3, max(cols.min() - 2, 0): cols.max() + 3] = True
    return region


def test_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="n_train >= 1"):
        write_synthetic_dataset(tmp_path, n_train=0, n_val=1, seed=0)
    with pytest.raises(ValueError, match="too small"):
        write_synthetic_dataset(tmp_path, n_train=1, n_val=0, seed=0, image_size=(20, 20))


def test_layout_parameters_narrow_counts_and_shapes(tmp_path):
    dataset = write_synthetic_dataset(tmp_path, n_train=24, n_val=2, seed=0, min_objects=1, max_objects=3,
                                      shapes=("rectangle", "triangle"))
    counts, kinds = [], set()
    for path in (dataset.train_jsonl, dataset.val_jsonl):
        for line in path.read_text().splitlines():
            objects = json.loads(line)["objects"]
            counts.append(len(objects))
            kinds |= {obj["desc"].split()[1] for obj in objects}
    assert min(counts) >= 1 and max(counts) <= 3 and len(set(counts)) == 3  # 26 draws cover 1, 2 and 3
    assert kinds == {"rectangle", "triangle"}


def test_default_layout_arguments_change_nothing(tmp_path):
    from coordexp.runtime.toy.synthetic import SHAPES

    plain = write_synthetic_dataset(tmp_path / "plain", n_train=5, n_val=1, seed=2)
    explicit = write_synthetic_dataset(tmp_path / "explicit", n_train=5, n_val=1, seed=2, min_objects=0,
                                       max_objects=8, shapes=SHAPES)
    assert _digest(plain.root) == _digest(explicit.root)


def test_count_weights_skew_the_object_counts(tmp_path):
    """Zero-weight counts never occur and the heavy count dominates; no weights keeps the uniform draw's bytes."""
    dataset = write_synthetic_dataset(tmp_path / "tail", n_train=60, n_val=0, seed=1, min_objects=1, max_objects=4,
                                      count_weights=(6, 0, 0, 1))
    counts = [len(json.loads(line)["objects"]) for line in dataset.train_jsonl.read_text().splitlines()]
    assert set(counts) == {1, 4} and counts.count(1) > 2 * counts.count(4)
    again = write_synthetic_dataset(tmp_path / "again", n_train=60, n_val=0, seed=1, min_objects=1, max_objects=4,
                                    count_weights=[6, 0, 0, 1])
    assert _digest(again.root) == _digest(dataset.root)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_objects": 1, "max_objects": 2, "count_weights": (1.0,)}, "must hold 2 non-negative weights"),
        ({"count_weights": (0,) * 9}, "positive sum"),
        ({"count_weights": (-1,) + (1,) * 8}, "non-negative"),
        ({"min_objects": 3, "max_objects": 2}, "min_objects <= max_objects"),
        ({"max_objects": 9}, "max_objects <= 8"),
        ({"shapes": ("circle",)}, "non-empty subset"),
        ({"shapes": ()}, "non-empty subset"),
    ],
)
def test_rejects_bad_layouts(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_synthetic_dataset(tmp_path, n_train=1, n_val=0, seed=0, **kwargs)
