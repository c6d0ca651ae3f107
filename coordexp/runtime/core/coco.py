"""COCO-style datasets <-> coordexp JSONL records, and scored predictions -> a COCO results list (numpy only).

Coordinates: a norm1000 bin ``b`` of an image side of ``size`` pixels is the continuous coordinate
``b * size / 1000`` (the raster convention of matching and the synthetic data), so a pixel coordinate ``x`` becomes
``round(x * 1000 / size)`` clamped to 0..999 and a round trip moves a coordinate by at most one bin.

Readers: COCO instances JSON (LVIS too: same layout, ``coco_url`` when there is no ``file_name``) and ODVG JSONL
(``{"filename", "width", "height", "detection": {"instances": [{"bbox": xyxy, "label", "category"}]}}``). A
single-part polygon segmentation becomes ``poly``; anything else with a box becomes ``bbox_2d``; a crowd annotation
becomes an ignore region (the record's ``crowd``, by its box: never trained, ``iscrowd`` in COCO AP); RLE annotations
are skipped and counted. Bad input (missing image size, a box outside the image, an unknown category,
...) raises :class:`ConversionError` listing ``file: record: problem`` lines (exit 2); nothing is half-converted.
Hostile input is a problem of its record too: integer literals over :data:`~coordexp.runtime.core.untrusted_json.MAX_NUMBER_DIGITS` digits are never
converted, numbers beyond :data:`MAX_ABS_VALUE` are refused, ids and labels must be integers (or strings), and
JSON nested deeper than the reader recurses is a problem of its file or line.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Literal, Mapping, Sequence

import numpy as np

from coordexp.errors import UserInputError
from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.tokens import NUM_COORD_BINS
from coordexp.runtime.core import untrusted_json
from coordexp.runtime.core.untrusted_json import LongNumber

__all__ = [
    "BOX_TOLERANCE_PX",
    "ConversionError",
    "ConvertedDataset",
    "CocoImage",
    "ScoredObject",
    "pixel_to_bin",
    "bin_to_pixel",
    "object_pixel_box",
    "object_pixel_polygon",
    "object_pixel_area",
    "coco_to_records",
    "odvg_to_records",
    "load_json",
    "predictions_to_coco_results",
    "build_coco_gt",
    "coco_results",
]

# COCO boxes are floats written by many tools; a coordinate this far past the image border is rounding, not an error.
BOX_TOLERANCE_PX = 1.0
MAX_REPORTED_PROBLEMS = 10
MAX_ABS_VALUE = 2.0**53  # pixel values, sizes and scores beyond this are no image's (and float sums lose exactness)
Geometry = Literal["poly", "bbox"]


class ConversionError(UserInputError, ValueError):
    """The source dataset cannot be converted; ``problems`` holds one ``file: record: problem`` line each."""

    def __init__(self, problems: Sequence[str], total: int | None = None, *, hint: str = "") -> None:
        self.problems = tuple(problems)
        total = len(self.problems) if total is None else total
        more = f"\n  ... and {total - len(self.problems)} more" if total > len(self.problems) else ""
        head = f"{total} problem(s) in the input:" if total > 1 else "input problem:"
        super().__init__(head + "".join(f"\n  {p}" for p in self.problems) + more, hint=hint)


def pixel_to_bin(value: float, size: int) -> int:
    """Pixel coordinate -> norm1000 bin (round to nearest, clamped to 0..999)."""
    return min(NUM_COORD_BINS - 1, max(0, int(math.floor(value * NUM_COORD_BINS / size + 0.5))))


def bin_to_pixel(bin_index: int, size: int) -> float:
    """Norm1000 bin -> continuous pixel coordinate (the inverse of :func:`pixel_to_bin` up to one bin)."""
    return bin_index * size / NUM_COORD_BINS


@dataclass(frozen=True)
class CocoImage:
    """One image of an evaluation set: its COCO id, pixel size, file name and ground-truth objects (norm1000)."""

    image_id: int
    width: int
    height: int
    file_name: str
    objects: tuple[DetObject, ...] = ()
    crowd: tuple[DetObject, ...] = ()  # ignore regions: COCO's ``iscrowd`` annotations


@dataclass(frozen=True)
class ScoredObject:
    """A predicted object with its ranking score (higher ranks first) on the image ``image_id``."""

    image_id: int
    obj: DetObject
    score: float


@dataclass
class ConvertedDataset:
    """What a reader produced: JSONL-ready records, the category names in id order, and what it skipped."""

    records: list[dict[str, Any]]
    categories: list[str]
    skipped: Counter = field(default_factory=Counter)  # reason -> annotations not converted
    as_box: Counter = field(default_factory=Counter)  # reason -> polygons written as their box
    crowd_regions: int = 0  # COCO crowd annotations kept as the records' ``crowd`` ignore regions
    origins: list[str] = field(default_factory=list)  # per record: where it came from ("images[3] (id 7)", "line 2")

    @property
    def n_objects(self) -> int:
        return sum(len(r["objects"]) for r in self.records)


# ------------------------------------------------------------------------------------------------ geometry helpers


def object_pixel_polygon(obj: DetObject, width: int, height: int) -> np.ndarray:
    """Vertices in pixels, ``(N, 2)``; a box gives its 4 corners."""
    points = obj.points()
    return points * np.array([width / NUM_COORD_BINS, height / NUM_COORD_BINS])


def object_pixel_box(obj: DetObject, width: int, height: int) -> list[float]:
    """COCO ``[x, y, w, h]`` in pixels (a polygon's enclosing box)."""
    points = object_pixel_polygon(obj, width, height)
    x1, y1 = points.min(axis=0)
    x2, y2 = points.max(axis=0)
    return [float(x1), float(y1), float(x2 - x1), float(y2 - y1)]


def object_pixel_area(obj: DetObject, width: int, height: int) -> float:
    """Area in square pixels: a box's area, a polygon's shoelace area (COCO's size buckets read it)."""
    points = object_pixel_polygon(obj, width, height)
    if obj.geometry == "bbox_2d":
        _, _, w, h = object_pixel_box(obj, width, height)
        return w * h
    x, y = points[:, 0], points[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2.0)


def _flat_pixels(obj: DetObject, width: int, height: int) -> list[float]:
    return [float(v) for v in object_pixel_polygon(obj, width, height).reshape(-1)]


# ------------------------------------------------------------------------------------------------ readers


class _Problems:
    """Collects ``file: where: problem`` lines; the first few are shown, all are counted."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: list[str] = []
        self.total = 0

    def add(self, where: str, message: str) -> None:
        self.total += 1
        if len(self.lines) < MAX_REPORTED_PROBLEMS:
            self.lines.append(f"{self.source}: {where}: {message}")

    def raise_if_any(self) -> None:
        if self.total:
            raise ConversionError(self.lines, self.total, hint="fix the listed records; nothing was written")


def load_json(text: str) -> Any:
    """``json.loads`` for untrusted text: long integer literals stay :class:`LongNumber`; a document nested
    deeper than the reader recurses raises ``ValueError`` like any other bad JSON."""
    try:
        return untrusted_json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a message quotes user input, never all of it)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_lines(lines: Iterable[str], problems: "_Problems") -> Iterator[tuple[str, Any]]:
    """``("line N", value)`` for each non-blank JSONL line; a line that is not JSON is recorded as a problem."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield f"line {number}", load_json(line)
        except ValueError as exc:
            problems.add(f"line {number}", f"not valid JSON ({str(exc)[:120]})")


def _number(value: Any) -> bool:
    """A finite int or float no larger than :data:`MAX_ABS_VALUE` (bools, long literals, inf and nan are not)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and abs(value) <= MAX_ABS_VALUE)


def _int_id(value: Any) -> bool:
    """An id: an int that is not a bool (so lists, dicts, floats, strings and long literals are refused)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _size(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if _number(value) and value > 0 and float(value).is_integer():
        return int(value)
    return None


def _box_bins(x1: float, y1: float, x2: float, y2: float, width: int, height: int) -> tuple[list[int] | None, str]:
    """xyxy pixels -> bins, or ``(None, why)`` when the box is inverted or leaves the image."""
    tol = BOX_TOLERANCE_PX
    if x2 < x1 or y2 < y1:
        return None, f"box [{x1:g}, {y1:g}, {x2:g}, {y2:g}] (xyxy pixels) has negative width or height"
    if x1 < -tol or y1 < -tol or x2 > width + tol or y2 > height + tol:
        return None, (f"box [{x1:g}, {y1:g}, {x2:g}, {y2:g}] (xyxy pixels) lies outside the {width}x{height} image "
                      f"(more than {tol:g} px past its border)")
    return [pixel_to_bin(x1, width), pixel_to_bin(y1, height), pixel_to_bin(x2, width), pixel_to_bin(y2, height)], ""


def _numeric(value: Any) -> bool:
    """A JSON number of any magnitude: an int or float (inf and nan included) or a long literal, not a bool."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or isinstance(value, LongNumber)


def _polygon_bins(points: Sequence[Any], width: int, height: int) -> tuple[list[int] | None, str]:
    """Pixel polygon -> bins; ``(None, "degenerate")`` for too few points or values that are no numbers (the box
    stands in), ``(None, why)`` for a coordinate outside the image, at any magnitude (a long literal or one that
    overflows to infinity too: they are out of the image like 9,000 is)."""
    tol = BOX_TOLERANCE_PX
    outside = f"polygon leaves the {width}x{height} image (more than {tol:g} px past its border)"
    if len(points) < 6 or len(points) % 2 or not all(_numeric(v) for v in points):
        return None, "degenerate"
    if any(isinstance(v, float) and math.isnan(v) for v in points):
        return None, "polygon coordinate NaN is not a number"
    if not all(_number(v) for v in points):
        return None, outside
    xs, ys = points[0::2], points[1::2]
    if min(xs) < -tol or min(ys) < -tol or max(xs) > width + tol or max(ys) > height + tol:
        return None, outside
    out: list[int] = []
    for x, y in zip(xs, ys):
        out += [pixel_to_bin(x, width), pixel_to_bin(y, height)]
    return out, ""


def _image_name(raw: Mapping[str, Any]) -> str | None:
    name = raw.get("file_name")
    if isinstance(name, str) and name:
        return name
    url = raw.get("coco_url")  # LVIS
    if isinstance(url, str) and url:
        return url.rstrip("/").rsplit("/", 1)[-1]
    return None


def coco_to_records(
    document: Mapping[str, Any], *, source: str, image_prefix: str = "", geometry: Geometry = "poly"
) -> ConvertedDataset:
    """COCO / LVIS instances -> records ``{"images": [prefix + file_name], "width", "height", "objects",
    "coco_image_id"}`` in image order; ``geometry="bbox"`` writes every object as its box."""
    problems = _Problems(source)
    if not isinstance(document, Mapping) or not isinstance(document.get("images"), list):
        raise ConversionError([f"{source}: top level: expected a COCO instances object with an \"images\" list"])
    categories_raw = document.get("categories")
    annotations = document.get("annotations", [])
    if not isinstance(categories_raw, list) or not isinstance(annotations, list):
        raise ConversionError([f"{source}: top level: expected \"categories\" and \"annotations\" lists"])
    names: dict[int, str] = {}
    for i, cat in enumerate(categories_raw):
        cid, name = (cat.get("id"), cat.get("name")) if isinstance(cat, Mapping) else (None, None)
        if not _int_id(cid) or not isinstance(name, str) or not name.strip():
            problems.add(f"categories[{i}]", "expected {\"id\": int, \"name\": non-empty string}")
        elif cid in names:
            problems.add(f"categories[{i}]", f"duplicate category id {cid}")
        else:
            names[cid] = name.strip()
    images: dict[int, dict[str, Any]] = {}
    index: dict[int, int] = {}  # image id -> its position in "images" (where a record came from)
    broken_images: set[int] = set()  # listed already: their annotations add no second problem
    for i, img in enumerate(document["images"]):
        iid = img.get("id") if isinstance(img, Mapping) else None
        where = f"images[{i}] (id {iid})"
        if not _int_id(iid):
            problems.add(f"images[{i}]", "expected an object with an integer \"id\"" if isinstance(img, Mapping)
                         else f"expected an image object, got {_short(img)}")
            continue
        if iid in images or iid in broken_images:
            problems.add(where, "duplicate image id")
            continue
        width, height, name = _size(img, "width"), _size(img, "height"), _image_name(img)
        broken_images.add(iid)
        if width is None or height is None:
            problems.add(where, f"missing image size: width={_short(img.get('width'))}, "
                                f"height={_short(img.get('height'))} (positive integer pixels are needed to turn "
                                "pixels into norm1000 bins)")
            continue
        if name is None:
            problems.add(where, "no \"file_name\" (or LVIS \"coco_url\")")
            continue
        broken_images.discard(iid)
        index[iid] = i
        images[iid] = {"images": [image_prefix + name], "width": width, "height": height, "objects": [],
                       "coco_image_id": iid}
    result = ConvertedDataset(records=[], categories=[names[k] for k in sorted(names)])
    for i, ann in enumerate(annotations):
        if not isinstance(ann, Mapping):
            problems.add(f"annotations[{i}]", "expected an object")
            continue
        where = f"annotations[{i}] (id {_short(ann.get('id'), 30)})"
        image_id, category_id = ann.get("image_id"), ann.get("category_id")
        record = images.get(image_id) if _int_id(image_id) else None
        if record is None:
            if not (_int_id(image_id) and image_id in broken_images):
                problems.add(where, f"image_id {_short(image_id)} is not in \"images\"")
            continue
        if not _int_id(category_id) or category_id not in names:
            problems.add(where, f"unknown category_id {_short(category_id)} (not in \"categories\")")
            continue
        segmentation = ann.get("segmentation")
        if ann.get("iscrowd"):  # an ignore region: kept by its box, never trained, ignored by COCO AP
            region = _coco_object(ann, None, record["width"], record["height"], "bbox", result, problems, where)
            if region is not None:
                record.setdefault("crowd", []).append({"desc": names[category_id], **region})
                result.crowd_regions += 1
            continue
        if isinstance(segmentation, Mapping):
            result.skipped["rle"] += 1
            continue
        obj = _coco_object(ann, segmentation, record["width"], record["height"], geometry, result, problems, where)
        if obj is not None:
            record["objects"].append({"desc": names[category_id], **obj})
    problems.raise_if_any()
    result.records = list(images.values())
    result.origins = [f"images[{index[iid]}] (id {iid})" for iid in images]
    return result


def _coco_object(ann: Mapping[str, Any], segmentation: Any, width: int, height: int, geometry: Geometry,
                 result: ConvertedDataset, problems: _Problems, where: str) -> dict[str, list[int]] | None:
    bbox = ann.get("bbox")
    if geometry == "poly" and isinstance(segmentation, list) and segmentation:
        parts = segmentation if all(isinstance(p, list) for p in segmentation) else [segmentation]
        if len(parts) == 1:
            poly, why = _polygon_bins(parts[0], width, height)
            if poly is not None:
                return {"poly": poly}
            if why != "degenerate":
                problems.add(where, why)
                return None
            result.as_box["degenerate_polygon"] += 1
        else:
            result.as_box["multipart_polygon"] += 1
    if not (isinstance(bbox, list) and len(bbox) == 4 and all(_number(v) for v in bbox)):
        problems.add(where, f"expected \"bbox\": [x, y, w, h] in pixels, got {_short(bbox)}")
        return None
    x, y, w, h = bbox
    box, why = _box_bins(x, y, x + w, y + h, width, height)
    if box is None:
        problems.add(where, why)
        return None
    return {"bbox_2d": box}


def odvg_to_records(
    lines: Iterable[str], *, source: str, image_prefix: str = "", label_map: Mapping[int, str] | None = None
) -> ConvertedDataset:
    """ODVG detection JSONL (xyxy pixel boxes) -> records; ``label_map`` names labels whose instance has no
    ``category``. Lines without a ``detection`` block (grounding-only) are skipped and counted."""
    problems = _Problems(source)
    result = ConvertedDataset(records=[], categories=[])
    seen: dict[str, None] = {}
    for where, raw in _json_lines(lines, problems):
        if not isinstance(raw, Mapping):
            problems.add(where, "expected a JSON object")
            continue
        width, height, name = _size(raw, "width"), _size(raw, "height"), raw.get("filename")
        if width is None or height is None:
            problems.add(where, f"missing image size: width={_short(raw.get('width'))}, "
                                f"height={_short(raw.get('height'))}")
            continue
        if not isinstance(name, str) or not name:
            problems.add(where, "no \"filename\"")
            continue
        detection = raw.get("detection")
        if not isinstance(detection, Mapping):
            result.skipped["no_detection_block"] += 1
            continue
        record = {"images": [image_prefix + name], "width": width, "height": height, "objects": []}
        instances = detection.get("instances")
        if instances is None:
            instances = []
        if not isinstance(instances, list):
            problems.add(where, f"\"detection.instances\" must be a list, got {_short(instances)}")
            continue
        for k, inst in enumerate(instances):
            iwhere = f"{where} instances[{k}]"
            if not isinstance(inst, Mapping):
                problems.add(iwhere, f"expected an object, got {_short(inst)}")
                continue
            category, label = inst.get("category"), inst.get("label")
            if not isinstance(category, str) or not category.strip():
                known = isinstance(label, (int, str)) and not isinstance(label, bool)
                category = (label_map or {}).get(label) if known else None
            if not isinstance(category, str) or not category.strip():
                problems.add(iwhere, f"unknown category (no \"category\" and label {_short(label)} is not in the "
                                     "label map)")
                continue
            bbox = inst.get("bbox")
            if not (isinstance(bbox, list) and len(bbox) == 4 and all(_number(v) for v in bbox)):
                problems.add(iwhere, f"expected \"bbox\": [x1, y1, x2, y2] in pixels, got {_short(bbox)}")
                continue
            box, why = _box_bins(*bbox, width, height)
            if box is None:
                problems.add(iwhere, why)
                continue
            seen.setdefault(category.strip(), None)
            record["objects"].append({"desc": category.strip(), "bbox_2d": box})
        result.records.append(record)
        result.origins.append(where)
    problems.raise_if_any()
    result.categories = list(seen)
    return result


# ------------------------------------------------------------------------------------------------ writers


def build_coco_gt(images: Sequence[CocoImage], categories: Sequence[str]) -> dict[str, Any]:
    """A COCO instances dict of ``images`` (pixel boxes, polygon segmentations, areas); category ids are
    ``1..len(categories)`` in the given order. Boxes get their rectangle as segmentation (for ``segm`` eval). Crowd
    regions are ``iscrowd: 1`` annotations: COCOeval ignores the detections that fall on them."""
    ids = {name: k + 1 for k, name in enumerate(categories)}
    out_images, annotations = [], []
    for image in images:
        out_images.append({"id": image.image_id, "width": image.width, "height": image.height,
                           "file_name": image.file_name})
        for obj, crowd in [*((o, 0) for o in image.objects), *((o, 1) for o in image.crowd)]:
            if obj.desc not in ids:
                raise ValueError(f"ground-truth desc {obj.desc!r} is not among the categories")
            annotations.append({
                "id": len(annotations) + 1, "image_id": image.image_id, "category_id": ids[obj.desc],
                "bbox": object_pixel_box(obj, image.width, image.height),
                "area": object_pixel_area(obj, image.width, image.height),
                "segmentation": [_flat_pixels(obj, image.width, image.height)], "iscrowd": crowd,
            })
    return {"images": out_images, "annotations": annotations,
            "categories": [{"id": ids[name], "name": name} for name in categories]}


def coco_results(
    predictions: Iterable[ScoredObject], sizes: Mapping[int, tuple[int, int]], category_ids: Mapping[str, int],
) -> tuple[list[dict[str, Any]], Counter]:
    """Scored predictions -> a COCO results list (bbox + polygon segmentation in pixels). A prediction whose desc
    is no known category cannot be scored by COCO: it is left out and counted under ``unknown_category``."""
    results: list[dict[str, Any]] = []
    left_out: Counter = Counter()
    for pred in predictions:
        category = category_ids.get(pred.obj.desc)
        if category is None:
            left_out["unknown_category"] += 1
            continue
        width, height = sizes[pred.image_id]
        results.append({
            "image_id": pred.image_id, "category_id": category,
            "bbox": object_pixel_box(pred.obj, width, height),
            "segmentation": [_flat_pixels(pred.obj, width, height)],
            "score": float(pred.score),
        })
    return results, left_out


def relative_image_name(path: str, root: str | None) -> str:
    """``path`` relative to ``root`` when it lies under it (COCO ``file_name``), else its base name."""
    if root:
        try:
            rel = os.path.relpath(path, root)
            if not rel.startswith(".."):
                return rel.replace(os.sep, "/")
        except ValueError:
            pass
    return os.path.basename(path)


def _suffixes(path: str) -> list[str]:
    parts = [p for p in path.replace("\\", "/").split("/") if p]
    return ["/".join(parts[k:]) for k in range(len(parts))]


def _prediction_object(raw: Any) -> tuple[DetObject, float] | str:
    """One ``{"desc", "bbox_2d" | "poly", "score"}`` of a predictions file, or why it is not one."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("desc"), str):
        return "expected {\"desc\", \"bbox_2d\" | \"poly\", \"score\"}"
    kind = "bbox_2d" if "bbox_2d" in raw else "poly" if "poly" in raw else None
    coords = raw.get(kind) if kind else None
    if kind is None or not isinstance(coords, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < NUM_COORD_BINS for v in coords):
        return "expected \"bbox_2d\" or \"poly\" holding norm1000 integers 0..999"
    if (kind == "bbox_2d" and len(coords) != 4) or (kind == "poly" and (len(coords) < 6 or len(coords) % 2)):
        return f"{kind} has {len(coords)} values"
    score = raw.get("score", 1.0)
    if not _number(score):
        return f"score {_short(score)} is not a finite number"
    return DetObject(raw["desc"], kind, tuple(coords)), float(score)


def _gt_index(coco_gt: Any, gt_source: str) -> tuple[dict[str, int], dict[int, tuple[int, int]], dict[str, int]]:
    """File name -> image id, image id -> (width, height), category name -> id of a COCO instances document; a
    document of the wrong shape, or an image or category without an integer id, is a :class:`ConversionError`."""
    problems = _Problems(gt_source)
    if not isinstance(coco_gt, Mapping):
        raise ConversionError([f"{gt_source}: top level: expected a COCO instances object, got {_short(coco_gt)}"])
    images, categories = coco_gt.get("images", []), coco_gt.get("categories", [])
    if not isinstance(images, list) or not isinstance(categories, list):
        raise ConversionError([f"{gt_source}: top level: expected \"images\" and \"categories\" lists"])
    by_name: dict[str, int] = {}
    sizes: dict[int, tuple[int, int]] = {}
    for i, img in enumerate(images):
        if not isinstance(img, Mapping) or not _int_id(img.get("id")):
            problems.add(f"images[{i}]", f"expected an image object with an integer \"id\", got {_short(img)}")
            continue
        name, width, height = _image_name(img), _size(img, "width"), _size(img, "height")
        if name is not None and width and height:
            by_name[name] = img["id"]
            sizes[img["id"]] = (width, height)
    category_ids: dict[str, int] = {}
    for i, cat in enumerate(categories):
        if not isinstance(cat, Mapping) or not _int_id(cat.get("id")) or not isinstance(cat.get("name"), str):
            problems.add(f"categories[{i}]", f"expected {{\"id\": int, \"name\": string}}, got {_short(cat)}")
            continue
        category_ids[cat["name"].strip()] = cat["id"]
    problems.raise_if_any()
    return by_name, sizes, category_ids


def predictions_to_coco_results(
    lines: Iterable[str], coco_gt: Mapping[str, Any], *, source: str, gt_source: str = "ground truth"
) -> tuple[list[dict[str, Any]], Counter]:
    """A predictions JSONL (``coordexp eval`` writes one: ``{"image", "width", "height", "objects": [{"desc",
    geometry, "score"}]}``) -> COCO results with ``coco_gt``'s image and category ids. Images are matched by
    ``file_name`` (the longest path suffix that is one), descs by category name; an unknown desc is counted."""
    by_name, sizes, category_ids = _gt_index(coco_gt, gt_source)
    problems = _Problems(source)
    scored: list[ScoredObject] = []
    for where, raw in _json_lines(lines, problems):
        if not isinstance(raw, Mapping):
            problems.add(where, f"expected a JSON object {{\"image\", \"objects\"}}, got {_short(raw)}")
            continue
        image = raw.get("image")
        image_id = next((by_name[s] for s in _suffixes(image) if s in by_name), None) if isinstance(image, str) else None
        if image_id is None:
            problems.add(where, f"image {_short(image)} matches no file_name of {gt_source}")
            continue
        objects = raw.get("objects")
        if objects is None:
            objects = []
        if not isinstance(objects, list):
            problems.add(where, f"\"objects\" must be a list, got {_short(objects)}")
            continue
        for k, obj in enumerate(objects):
            parsed = _prediction_object(obj)
            if isinstance(parsed, str):
                problems.add(f"{where} objects[{k}]", parsed)
                continue
            scored.append(ScoredObject(image_id, parsed[0], parsed[1]))
    problems.raise_if_any()
    return coco_results(scored, sizes, category_ids)
