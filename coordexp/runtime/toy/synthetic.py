"""A deterministic synthetic detection dataset: flat-coloured rectangles, triangles and polygons on PNG images.

Geometry is chosen in norm1000 bins first and then drawn, so the labels are exact: a norm1000 value ``v`` is the
continuous image coordinate ``v * size / 1000`` (the raster convention of matching), and a pixel belongs to a shape
when its centre lies inside it. Shapes sit in distinct cells of a 3 x 3 grid, so they never overlap or occlude.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["COLOURS", "SHAPES", "SyntheticDataset", "add_position_code", "write_synthetic_dataset", "write_splits",
           "synthetic_record"]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 200),
    "white": (245, 245, 245),
}
SHAPES: tuple[str, ...] = ("rectangle", "triangle", "pentagon", "hexagon")
_VERTICES = {"triangle": 3, "pentagon": 5, "hexagon": 6}
_GRID = 3
_MAX_OBJECTS = 8  # at most one shape per grid cell, and one cell stays empty


@dataclass(frozen=True)
class SyntheticDataset:
    """Where :func:`write_synthetic_dataset` put things (image paths in the JSONL are relative to ``root``)."""

    root: Path
    train_jsonl: Path
    val_jsonl: Path
    image_dir: Path


def _to_pixels(v: int, size: int) -> float:
    return v * size / 1000.0


def _rectangle(rng: random.Random, cell: tuple[int, int, int, int]) -> list[int]:
    x_lo, y_lo, x_hi, y_hi = cell
    w = rng.randint(max(60, (x_hi - x_lo) // 3), x_hi - x_lo)
    h = rng.randint(max(60, (y_hi - y_lo) // 3), y_hi - y_lo)
    x1, y1 = rng.randint(x_lo, x_hi - w), rng.randint(y_lo, y_hi - h)
    return [x1, y1, x1 + w, y1 + h]


def _polygon(rng: random.Random, cell: tuple[int, int, int, int], n_vertices: int) -> list[int]:
    x_lo, y_lo, x_hi, y_hi = cell
    radius = rng.uniform(0.35, 0.5) * min(x_hi - x_lo, y_hi - y_lo)
    cx = rng.uniform(x_lo + radius, x_hi - radius)
    cy = rng.uniform(y_lo + radius, y_hi - radius)
    start = rng.uniform(0, 2 * math.pi)
    points = []
    for k in range(n_vertices):
        # angles increase with y pointing down, so vertices run clockwise on screen
        angle = start + 2 * math.pi * k / n_vertices + rng.uniform(-0.25, 0.25) * (2 * math.pi / n_vertices)
        r = radius * rng.uniform(0.8, 1.0)
        points.append((round(cx + r * math.cos(angle)), round(cy + r * math.sin(angle))))
    first = min(range(n_vertices), key=lambda i: (points[i][1], points[i][0]))  # top-most, then left-most
    points = points[first:] + points[:first]
    return [c for p in points for c in p]


def _cells(width_bins: int = 1000) -> list[tuple[int, int, int, int]]:
    """Grid cells in norm1000 bins with a margin, so shapes neither touch each other nor the image border."""
    step = width_bins // _GRID
    margin = 20
    return [
        (col * step + margin, row * step + margin, (col + 1) * step - margin, (row + 1) * step - margin)
        for row in range(_GRID)
        for col in range(_GRID)
    ]


def _draw(image: Any, kind: str, coords: list[int], colour: tuple[int, int, int]) -> None:
    import numpy as np
    from PIL import Image, ImageDraw

    width, height = image.size
    draw = ImageDraw.Draw(image)
    if kind == "rectangle":
        x1, y1, x2, y2 = coords
        # pixels whose centre c + 0.5 lies in [X1, X2): columns ceil(X1 - 0.5) .. ceil(X2 - 0.5) - 1
        c0, c1 = math.ceil(_to_pixels(x1, width) - 0.5), math.ceil(_to_pixels(x2, width) - 0.5) - 1
        r0, r1 = math.ceil(_to_pixels(y1, height) - 0.5), math.ceil(_to_pixels(y2, height) - 0.5) - 1
        if c1 >= c0 and r1 >= r0:
            draw.rectangle([c0, r0, c1, r1], fill=colour)
        return
    xs = np.arange(width) + 0.5
    ys = (np.arange(height) + 0.5)[:, None]
    inside = np.zeros((height, width), dtype=bool)
    vertices = [(_to_pixels(coords[i], width), _to_pixels(coords[i + 1], height)) for i in range(0, len(coords), 2)]
    for (x0, y0), (x1, y1) in zip(vertices, vertices[1:] + vertices[:1]):
        if y0 == y1:
            continue
        crosses = (y0 > ys) != (y1 > ys)  # half-open in y, so a vertex is counted once
        x_at = x0 + (ys - y0) * (x1 - x0) / (y1 - y0)
        inside ^= crosses & (xs < x_at)  # even-odd rule on pixel centres
    mask = Image.fromarray(inside.astype(np.uint8) * 255)
    image.paste(colour, (0, 0, width, height), mask)


def _check_layout(
    min_objects: int, max_objects: int, shapes: tuple[str, ...], count_weights: tuple[float, ...] | None = None,
    position_code: float = 0.0,
) -> None:
    if not 0.0 <= position_code <= 255.0:  # also refuses NaN
        raise ValueError(f"position_code must be an amplitude in [0, 255] 8-bit levels (0 = none), got {position_code}")
    if not 0 <= min_objects <= max_objects <= _MAX_OBJECTS:
        raise ValueError(
            f"need 0 <= min_objects <= max_objects <= {_MAX_OBJECTS} (one shape per cell of a {_GRID}x{_GRID} grid), "
            f"got min_objects={min_objects}, max_objects={max_objects}"
        )
    unknown = [s for s in shapes if s not in SHAPES]
    if not shapes or unknown:
        raise ValueError(f"shapes must be a non-empty subset of {list(SHAPES)}; got {list(shapes)}")
    if count_weights is not None:
        n = max_objects - min_objects + 1
        if len(count_weights) != n or any(not w >= 0 for w in count_weights) or not sum(count_weights) > 0:
            raise ValueError(
                f"count_weights must hold {n} non-negative weights (one per object count {min_objects}..{max_objects}) "
                f"with a positive sum; got {list(count_weights)}"
            )


def synthetic_record(
    rng: random.Random,
    image_size: tuple[int, int],
    *,
    min_objects: int = 0,
    max_objects: int = _MAX_OBJECTS,
    shapes: tuple[str, ...] = SHAPES,
    count_weights: tuple[float, ...] | None = None,
    position_code: float = 0.0,
) -> tuple[Any, list[dict[str, Any]]]:
    """One image and its objects (norm1000 ints), sorted top-to-bottom then left-to-right.

    The object count is uniform in ``[min_objects, max_objects]`` (or drawn with ``count_weights``, one weight per
    count, e.g. a long tail like real detection sets) and each kind uniform over ``shapes``. ``position_code`` > 0
    adds :func:`add_position_code` with that amplitude (8-bit levels).
    """
    from PIL import Image

    _check_layout(min_objects, max_objects, tuple(shapes), count_weights, position_code)
    width, height = image_size
    grey = rng.randint(20, 70)
    image = Image.new("RGB", (width, height), (grey, grey, grey))
    if count_weights is None:
        n_objects = rng.randint(min_objects, max_objects)
    else:
        n_objects = rng.choices(range(min_objects, max_objects + 1), weights=count_weights)[0]
    objects = []
    for cell in rng.sample(_cells(), n_objects):
        colour_name = rng.choice(sorted(COLOURS))
        kind = rng.choice(tuple(shapes))
        if kind == "rectangle":
            coords = _rectangle(rng, cell)
            entry = {"desc": f"{colour_name} {kind}", "bbox_2d": coords}
        else:
            coords = _polygon(rng, cell, _VERTICES[kind])
            entry = {"desc": f"{colour_name} {kind}", "poly": coords}
        _draw(image, kind, coords, COLOURS[colour_name])
        objects.append(entry)
    objects.sort(key=lambda o: (min((o.get("bbox_2d") or o["poly"])[1::2]), min((o.get("bbox_2d") or o["poly"])[::2])))
    if position_code:
        image = add_position_code(image, position_code)
    return image, objects


def add_position_code(image: Any, amplitude: float) -> Any:
    """``image`` with a pixel-level position code: red carries x and blue carries y as a +-1 checkerboard whose
    amplitude grows linearly across the image (from ``-amplitude`` to ``+amplitude`` levels), added to every pixel.

    Why: Qwen2-VL has no absolute position embedding (rotary only), so a model trained from scratch has no cheap way
    to say *where* a patch is; a pre-trained checkpoint learned that from web-scale data. A 14 x 14 checkerboard
    filter of the (linear) patch embedding reads this code exactly and ignores flat colours, so a tiny model on CPU
    can learn localisation in minutes (docs/design.md, decision 10).
    """
    import numpy as np
    from PIL import Image

    pixels = np.asarray(image, dtype=np.float32).copy()
    height, width = pixels.shape[:2]
    checker = np.where((np.arange(height)[:, None] + np.arange(width)[None, :]) % 2 == 0, 1.0, -1.0)
    ramp_x = (2.0 * (np.arange(width) + 0.5) / width - 1.0)[None, :]
    ramp_y = (2.0 * (np.arange(height) + 0.5) / height - 1.0)[:, None]
    pixels[..., 0] += amplitude * ramp_x * checker
    pixels[..., 2] += amplitude * ramp_y * checker
    return Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), mode="RGB")


def write_synthetic_dataset(
    directory: str | Path,
    *,
    n_train: int,
    n_val: int,
    seed: int,
    image_size: tuple[int, int] = (112, 112),
    min_objects: int = 0,
    max_objects: int = _MAX_OBJECTS,
    shapes: tuple[str, ...] = SHAPES,
    count_weights: tuple[float, ...] | None = None,
    position_code: float = 0.0,
) -> SyntheticDataset:
    """Write ``train.jsonl``, ``val.jsonl`` and ``images/*.png`` under ``directory``; same arguments -> same bytes.

    Each image's content depends only on ``(seed, split, index)`` and the layout arguments, so growing ``n_train``
    keeps existing images. ``min_objects``/``max_objects``/``shapes`` narrow the task (the CPU demo uses fewer,
    simpler shapes so a tiny model learns the format in minutes); ``count_weights`` skews the object counts
    (benchmarks use a long tail, so sample lengths vary as in real detection data).
    """
    if n_train < 1 or n_val < 0:
        raise ValueError(f"need n_train >= 1 and n_val >= 0, got n_train={n_train}, n_val={n_val}")
    shapes = tuple(shapes)
    count_weights = None if count_weights is None else tuple(float(w) for w in count_weights)
    _check_layout(min_objects, max_objects, shapes, count_weights, position_code)
    width, height = image_size
    if width < 28 or height < 28:
        raise ValueError(f"image_size {image_size} is too small; use at least 28 x 28 pixels")

    def record(rng: random.Random) -> tuple[Any, list[dict[str, Any]]]:
        return synthetic_record(rng, (width, height), min_objects=min_objects, max_objects=max_objects, shapes=shapes,
                                count_weights=count_weights, position_code=position_code)

    return write_splits(directory, n_train=n_train, n_val=n_val, rng_key=f"coordexp-synthetic:{seed}",
                        size=(width, height), record=record)


def write_splits(directory: str | Path, *, n_train: int, n_val: int, rng_key: str, size: tuple[int, int],
                 record: Callable[[random.Random], tuple[Any, list[dict[str, Any]]]]) -> SyntheticDataset:
    """``train.jsonl``, ``val.jsonl`` and ``images/*.png`` under ``directory``: image ``index`` of ``split`` is
    ``record(Random(f"{rng_key}:{split}:{index}"))``, so it depends only on those (same arguments -> same bytes)."""
    width, height = size
    root = Path(directory)
    image_dir = root / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, count in (("train", n_train), ("val", n_val)):
        lines = []
        for index in range(count):
            image, objects = record(random.Random(f"{rng_key}:{split}:{index}"))
            name = f"{split}_{index:05d}.png"
            image.save(image_dir / name, format="PNG", optimize=False)
            entry = {"images": [f"images/{name}"], "width": width, "height": height, "objects": objects}
            lines.append(json.dumps(entry, separators=(", ", ": ")))
        paths[split] = root / f"{split}.jsonl"
        paths[split].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return SyntheticDataset(root=root, train_jsonl=paths["train"], val_jsonl=paths["val"], image_dir=image_dir)
