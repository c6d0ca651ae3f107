"""The synthetic dataset is deterministic and its labels match the drawn pixels."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _checker_response(pixels, channel, row, col, patch=14):
    """What a 14 x 14 +-1 checkerboard filter of the (linear) patch embedding reads from one patch and channel."""
    block = pixels[row * patch:(row + 1) * patch, col * patch:(col + 1) * patch, channel].astype(np.float64)
    checker = np.where((np.arange(patch)[:, None] + np.arange(patch)[None, :]) % 2 == 0, 1.0, -1.0)
    return float((block * checker).sum()) / patch**2


@settings(max_examples=40, deadline=None)
@given(colour=st.tuples(*[st.integers(55, 200)] * 3), row=st.integers(0, 7), col=st.integers(0, 7),
       amplitude=st.floats(5.0, 50.0))
def test_position_code_is_read_exactly_by_a_checkerboard_filter(colour, row, col, amplitude):
    """Red's checkerboard response is the patch centre's x and blue's its y, linearly and whatever the flat colour
    under it: the property that lets a patch embedding learn where it is (docs/design.md)."""
    from PIL import Image

    from coordexp.runtime.toy.synthetic import add_position_code

    size, patch = 112, 14
    coded = np.asarray(add_position_code(Image.new("RGB", (size, size), colour), amplitude))
    # the ramp runs from -amplitude to +amplitude across the image; a patch reads it at its centre (within rounding)
    centre_x = 2.0 * (col + 0.5) * patch / size - 1.0
    centre_y = 2.0 * (row + 0.5) * patch / size - 1.0
    assert _checker_response(coded, 0, row, col) == pytest.approx(amplitude * centre_x, abs=0.5)
    assert _checker_response(coded, 2, row, col) == pytest.approx(amplitude * centre_y, abs=0.5)
    assert abs(_checker_response(coded, 1, row, col)) < 1e-9  # green carries nothing
    assert np.abs(coded.astype(int) - np.array(colour)).max() <= amplitude + 0.5  # a faint texture, not a repaint


def test_position_code_keeps_labels_and_layout(tmp_path):
    """The coded dataset has the same records as the plain one (the code changes pixels, never labels), different
    image bytes, and every pixel within the amplitude of the plain image's."""
    from PIL import Image

    plain = write_synthetic_dataset(tmp_path / "plain", n_train=6, n_val=2, seed=3, min_objects=1, max_objects=4)
    coded = write_synthetic_dataset(tmp_path / "coded", n_train=6, n_val=2, seed=3, min_objects=1, max_objects=4,
                                    position_code=40)
    assert plain.train_jsonl.read_text() == coded.train_jsonl.read_text()
    assert plain.val_jsonl.read_text() == coded.val_jsonl.read_text()
    for name in ("train_00000.png", "val_00001.png"):
        a = np.asarray(Image.open(plain.image_dir / name)).astype(int)
        b = np.asarray(Image.open(coded.image_dir / name)).astype(int)
        assert not np.array_equal(a, b) and np.abs(a - b).max() <= 40
        assert np.array_equal(a[..., 1], b[..., 1])


@pytest.mark.parametrize("amplitude", [-1.0, 256.0, float("nan")])
def test_rejects_bad_position_codes(tmp_path, amplitude):
    with pytest.raises(ValueError, match="position_code must be an amplitude"):
        write_synthetic_dataset(tmp_path, n_train=1, n_val=0, seed=0, position_code=amplitude)
