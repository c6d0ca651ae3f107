"""JSONL detection records -> validated :class:`DetectionRecord` objects.

One record per line: ``{"images": [path], "width", "height", "objects": [{"desc", "bbox_2d" | "poly"}]}`` with
norm1000 coordinates (ints 0..999 or ``"<|coord_k|>"`` strings). A bad record fails the whole load with
``file:line: field: problem`` and a fix, listing the first several problems at once; the trainer never meets a
record it would silently misread. Other top-level keys (ids, metadata) are ignored.

Hostile or careless input fails here, before any training step, as :class:`DatasetError` (exit 2): text is decoded as
UTF-8 (a bad byte is reported with its offset), numbers longer than :data:`MAX_NUMBER_DIGITS` digits are refused
before any int conversion, over-deep JSON nesting is a problem of its line, ``desc`` values may not hold a special-
token form (``<|...|>``), width/height are bounded by :data:`MAX_IMAGE_SIDE`, and every image path is checked
(NUL bytes, name length, ``~user``) and its file opened header-only (no pixel decoding) with a pixel cap of
:data:`MAX_IMAGE_PIXELS` (decompression bombs) and the processors' aspect-ratio limit :data:`MAX_ASPECT_RATIO`.
A file whose pixels are corrupt behind a valid header fails when it is decoded (``encoding.load_images``), with its
``file:line``.

Object order (``data.object_order``): ``sorted`` refuses, at load time, a record whose objects are not in top-left
order (:func:`top_left`); ``random`` reorders a training record's objects by :func:`object_permutation`, a pure
function of (seed, epoch, record index), applied by the trainer as batches are read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordexp.errors import UserInputError
from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.tokens import NUM_COORD_BINS, parse_coord_token
from coordexp.runtime.core import untrusted_json
from coordexp.runtime.core.untrusted_json import MAX_NUMBER_DIGITS, LongNumber
from coordexp.schema.data import OBJECT_ORDERS

__all__ = [
    "DetectionRecord",
    "DatasetError",
    "displayed_size",
    "upright",
    "size_mismatch",
    "EXIF_ORIENTATION",
    "ImageFileError",
    "load_records",
    "parse_record",
    "OBJECT_ORDERS",
    "top_left",
    "first_out_of_order",
    "object_permutation",
    "with_object_permutation",
    "open_image",
    "MAX_REPORTED_ERRORS",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "MAX_ASPECT_RATIO",
    "MAX_NUMBER_DIGITS",
]

MAX_REPORTED_ERRORS = 10
# 64 Mi pixels (8192 x 8192, 192 MiB as decoded RGB): far above what a Qwen-VL processor keeps after resizing, far
# below what takes a worker down; a header claiming more is refused before any pixel is decoded.
EXIF_ORIENTATION = 0x0112
MAX_IMAGE_PIXELS = 64 * 2**20
MAX_IMAGE_SIDE = 1_000_000  # record width/height bound (pixels)
MAX_ASPECT_RATIO = 200  # Qwen-VL image processors refuse longer/shorter side ratios above this
_MAX_NAME_BYTES, _MAX_PATH_BYTES = 255, 4096  # Linux NAME_MAX / PATH_MAX
_OBJECT_KEYS = frozenset({"desc", "bbox_2d", "poly"})
_SPECIAL_TOKEN = re.compile(r"<\|.*?\|>", re.DOTALL)
_UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class DetectionRecord:
    """One image (or several) with its ground-truth objects; ``source`` is ``"file:line"`` for error messages."""

    image_paths: tuple[Path, ...]
    width: int
    height: int
    objects: tuple[DetObject, ...]
    source: str
    crowd: tuple[DetObject, ...] = ()
    """COCO crowd regions (``iscrowd``): never trained, and COCO AP ignores the detections on them."""


class DatasetError(UserInputError, ValueError):
    """A JSONL file cannot be used; ``problems`` holds one ``file:line: field: message`` line per problem."""

    def __init__(self, problems: list[str], total: int | None = None):
        self.problems = tuple(problems)
        total = len(problems) if total is None else total
        more = f"\n  ... and {total - len(problems)} more" if total > len(problems) else ""
        head = f"{total} problem(s) in the dataset:" if total > 1 else "dataset problem:"
        super().__init__(head + "".join(f"\n  {p}" for p in problems) + more)


class ImageFileError(ValueError):
    """An image file cannot be used (unreadable, not an image, over the pixel cap); the message names the path."""


class _RecordProblem(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)


def _coord(value: Any, field: str) -> int:
    if isinstance(value, LongNumber):
        raise _RecordProblem(field, f"{value!r} is not an integer in 0..{NUM_COORD_BINS - 1}")
    if isinstance(value, str):
        bin_index = parse_coord_token(value.strip())
        if bin_index is None:
            raise _RecordProblem(field, f"{value!r} is not a coord token; use \"<|coord_k|>\" with k in 0..999 "
                                        "or a norm1000 integer")
        return bin_index
    if isinstance(value, bool) or not isinstance(value, int):
        hint = " (coordinates are pre-quantised norm1000 integers; round them when converting)" if isinstance(
            value, float) else ""
        raise _RecordProblem(field, f"{value!r} is not an integer in 0..{NUM_COORD_BINS - 1}{hint}")
    if not 0 <= value < NUM_COORD_BINS:
        raise _RecordProblem(field, f"{value} is outside 0..{NUM_COORD_BINS - 1}; coordinates are norm1000 bins "
                                    "(value / image size * 1000, clamped to 999)")
    return value


def _bbox(value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) != 4:
        raise _RecordProblem(field, f"expected a list of 4 coordinates [x1, y1, x2, y2], got {_short(value)}")
    x1, y1, x2, y2 = (_coord(v, f"{field}[{i}]") for i, v in enumerate(value))
    if x2 < x1:
        raise _RecordProblem(field, f"x2 ({x2}) < x1 ({x1}); boxes are [x1, y1, x2, y2] with x1 <= x2")
    if y2 < y1:
        raise _RecordProblem(field, f"y2 ({y2}) < y1 ({y1}); boxes are [x1, y1, x2, y2] with y1 <= y2")
    return (x1, y1, x2, y2)


def _poly(value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _RecordProblem(field, "expected a flat list [x1, y1, x2, y2, ...] or [[x, y], ...], got "
                                    f"{_short(value)}")
    if value and all(isinstance(p, list) for p in value):
        flat = []
        for i, pair in enumerate(value):
            if len(pair) != 2:
                raise _RecordProblem(f"{field}[{i}]", f"a point must be [x, y], got {_short(pair)}")
            flat.extend(_coord(v, f"{field}[{i}][{j}]") for j, v in enumerate(pair))
    elif any(isinstance(p, list) for p in value):
        raise _RecordProblem(field, "mixes [x, y] pairs and bare numbers; use one form")
    else:
        if len(value) % 2:
            raise _RecordProblem(field, f"has an odd number of values ({len(value)}); a flat polygon is "
                                        "x1, y1, x2, y2, ...")
        flat = [_coord(v, f"{field}[{i}]") for i, v in enumerate(value)]
    if len(flat) < 6:
        raise _RecordProblem(field, f"has {len(flat) // 2} point(s); a polygon needs at least 3 (use bbox_2d for "
                                    "boxes)")
    return tuple(flat)


def _short(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True) if not isinstance(value, str) else ascii(value)
    except (TypeError, ValueError, RecursionError):  # a LongNumber inside, or nesting deeper than dumps recurses
        text = repr(value) if isinstance(value, LongNumber) else f"<a {type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _printable(value: Any) -> str:
    """``str(value)`` with control and other non-printable characters escaped (file names reach the terminal)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(value))


def _object(raw: Any, field: str) -> DetObject:
    if not isinstance(raw, dict):
        raise _RecordProblem(field, f"expected an object {{\"desc\", \"bbox_2d\" | \"poly\"}}, got {_short(raw)}")
    unknown = sorted(set(raw) - _OBJECT_KEYS)
    if unknown:
        raise _RecordProblem(field, f"unknown key(s) {unknown}; an object has exactly \"desc\" and one of "
                                    "\"bbox_2d\" / \"poly\"")
    desc = raw.get("desc")
    if not isinstance(desc, str) or not desc.strip():
        raise _RecordProblem(f"{field}.desc", f"expected a non-empty string, got {_short(desc)}")
    _require_utf8(desc, f"{field}.desc")
    special = _SPECIAL_TOKEN.search(desc)
    if special:
        raise _RecordProblem(f"{field}.desc", f"contains the special-token form {_short(special.group())}; a desc is "
                                              "plain text (the tokenizer would read it as a control or coord "
                                              "token): remove or rewrite it")
    has_box, has_poly = "bbox_2d" in raw, "poly" in raw
    if has_box == has_poly:
        which = "both" if has_box else "neither"
        raise _RecordProblem(field, f"has {which} of \"bbox_2d\" and \"poly\"; give exactly one geometry")
    if has_box:
        return DetObject(desc=desc.strip(), geometry="bbox_2d", coords=_bbox(raw["bbox_2d"], f"{field}.bbox_2d"))
    return DetObject(desc=desc.strip(), geometry="poly", coords=_poly(raw["poly"], f"{field}.poly"))


def _positive_int(raw: dict, key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_IMAGE_SIDE:
        raise _RecordProblem(key, f"expected a positive integer up to {MAX_IMAGE_SIDE} (image {key} in pixels), "
                                  f"got {_short(value)}")
    return value


def open_image(path: Path) -> Any:
    """Open ``path`` lazily (PIL reads the header only) and check its size against :data:`MAX_IMAGE_PIXELS` and
    :data:`MAX_ASPECT_RATIO` before any pixel is decoded; the caller decodes (``convert``) and closes it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own cap below decides
            image = Image.open(path)
    except Image.DecompressionBombError as exc:
        raise ImageFileError(f"{path}: image header claims too many pixels ({exc}); the limit is "
                             f"{MAX_IMAGE_PIXELS} pixels (MAX_IMAGE_PIXELS): downscale or tile the image") from None
    except UnidentifiedImageError:
        raise ImageFileError(f"{path}: not a readable image (unknown format or corrupt header)") from None
    except OSError as exc:
        raise ImageFileError(f"{path}: cannot read image ({exc.strerror or exc})") from None
    except Exception as exc:  # noqa: BLE001 - PIL's format plugins raise ValueError, SyntaxError, struct.error...
        raise ImageFileError(f"{path}: not a readable image ({type(exc).__name__}: {exc})") from None
    width, height = image.size
    problem = None
    if width < 1 or height < 1:
        problem = f"has an empty size {width} x {height}"
    elif width * height > MAX_IMAGE_PIXELS:
        problem = (f"is {width} x {height} = {width * height} pixels, over the limit of {MAX_IMAGE_PIXELS} "
                   "(MAX_IMAGE_PIXELS, a decompression-bomb guard): downscale or tile the image")
    elif max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        problem = (f"is {width} x {height}, an aspect ratio over {MAX_ASPECT_RATIO} that Qwen-VL image processors "
                   "refuse: crop or pad it")
    if problem:
        image.close()
        raise ImageFileError(f"{path}: image {problem}")
    return image


def _require_utf8(text: str, field: str) -> None:
    """JSON ``\\ud800`` escapes decode to lone surrogates, which no tokenizer or file system can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _RecordProblem(field, f"{_short(text)} holds a lone surrogate {ascii(text[exc.start])[1:-1]} (a "
                                    "JSON \\uXXXX escape of half a character); write the whole character") from None


def _image_path(name: str, field: str, image_root: Path, check_files: bool) -> Path:
    _require_utf8(name, field)
    if "\x00" in name:
        raise _RecordProblem(field, f"{_short(name)} contains a NUL byte; write the plain file path")
    encoded = name.encode("utf-8", "surrogatepass")
    if len(encoded) > _MAX_PATH_BYTES or any(len(part) > _MAX_NAME_BYTES for part in encoded.split(b"/")):
        raise _RecordProblem(field, f"{_short(name)} is too long (a file name may have {_MAX_NAME_BYTES} bytes, "
                                    f"a path {_MAX_PATH_BYTES}); rename the file")
    try:
        path = Path(name).expanduser()
    except RuntimeError:  # "~someone/..." where someone has no home directory
        raise _RecordProblem(field, f"{_short(name)}: cannot expand {_short(name.split('/', 1)[0])} (no such user "
                                    "or home directory); write the path in full or relative to the image root"
                             ) from None
    path = path if path.is_absolute() else image_root / path
    if not check_files:
        return path
    try:
        exists = path.is_file()
    except OSError as exc:
        raise _RecordProblem(field, f"cannot check image {_printable(path)} ({exc.strerror or exc})") from None
    if not exists:
        raise _RecordProblem(field, f"image file not found: {_printable(path.resolve())} (relative paths resolve "
                                    f"against {image_root}; set data.image_root if the images live elsewhere)")
    try:
        open_image(path).close()
    except ImageFileError as exc:
        raise _RecordProblem(field, str(exc)) from None
    return path


def size_mismatch(path: Path, width: int, height: int) -> str | None:
    """Why a record's ``width`` x ``height`` is not its image as a viewer shows it (EXIF orientation applied), else
    None: boxes are read in the record's frame, so a record in the stored frame of a turned photo (or of another
    image) trains and evaluates boxes on the wrong pixels. ``convert`` and ``preflight`` ask."""
    with open_image(path) as image:
        stored, size = tuple(image.size), displayed_size(image)
    if size == (width, height):
        return None
    turned = f" (stored {stored[0]} x {stored[1]}, turned by its EXIF orientation)" if stored != size else ""
    return (f"the record says {width} x {height} pixels, but the image {_printable(path)} as a viewer shows it is "
            f"{size[0]} x {size[1]}{turned}; boxes are read in the record's frame: fix width/height (or the "
            "annotations) to the displayed image")


def displayed_size(image: Any) -> tuple[int, int]:
    """``(width, height)`` of an opened image as a viewer shows it: its EXIF orientation 5-8 turns it by 90 degrees
    (read from the header; nothing is decoded). Photos from phones carry it, and annotation tools (CVAT, Label Studio)
    annotate the turned image."""
    width, height = image.size
    try:
        orientation = image.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - a malformed EXIF block: the stored frame
        orientation = 1
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def upright(image: Any) -> Any:
    """The image in the frame a viewer shows (its EXIF orientation applied; the same image when it has none)."""
    from PIL import ImageOps

    try:
        return ImageOps.exif_transpose(image)
    except Exception:  # noqa: BLE001 - a malformed EXIF block: the stored frame
        return image


def parse_record(raw: Any, *, image_root: Path, source: str, check_files: bool = True) -> DetectionRecord:
    """Validate one decoded JSON line; raises :class:`DatasetError` with ``source`` and the field path."""
    try:
        return _parse(raw, image_root=image_root, source=source, check_files=check_files)
    except _RecordProblem as problem:
        raise DatasetError([f"{source}: {problem}"]) from None


def top_left(obj: DetObject) -> tuple[int, int]:
    """``(y, x)`` of the top-left corner of the object's box: a box's ``(y1, x1)``, a polygon's smallest y and
    smallest x (the corner of the box around its points, which need not be a point of the polygon)."""
    return min(obj.coords[1::2]), min(obj.coords[0::2])


def first_out_of_order(objects: tuple[DetObject, ...] | list[DetObject]) -> int | None:
    """Index of the first object whose top-left (:func:`top_left`, compared as ``(y, x)``) comes before the one
    of the object listed just before it; None when the objects are in top-left order (ties keep their order)."""
    for i in range(1, len(objects)):
        if top_left(objects[i]) < top_left(objects[i - 1]):
            return i
    return None


def _check_sorted(objects: tuple[DetObject, ...]) -> None:
    i = first_out_of_order(objects)
    if i is None:
        return
    (y, x), (prev_y, prev_x) = top_left(objects[i]), top_left(objects[i - 1])
    raise _RecordProblem(f"objects[{i}]", f"its top-left (y={y}, x={x}) comes before that of objects[{i - 1}] "
                                          f"(y={prev_y}, x={prev_x}); data.object_order: sorted needs each record's "
                                          "objects in top-left order (by y1, then x1): sort them, or set "
                                          "data.object_order: keep")


def object_permutation(seed: int, epoch: int, index: int, count: int) -> tuple[int, ...]:
    """A uniformly drawn order of ``count`` objects, a pure function of (seed, epoch, record index): position ``i``
    ranks by a BLAKE2b hash of ``(seed, epoch, index, i)``, so no library version or RNG state changes it."""
    def rank(i: int) -> bytes:
        return hashlib.blake2b(f"{int(seed)}/{int(epoch)}/{int(index)}/{i}".encode(), digest_size=16).digest()

    return tuple(sorted(range(count), key=lambda i: (rank(i), i)))


def with_object_permutation(record: DetectionRecord, *, seed: int, epoch: int, index: int) -> DetectionRecord:
    """``record`` with its objects in :func:`object_permutation` order (``data.object_order: random``)."""
    order = object_permutation(seed, epoch, index, len(record.objects))
    return dataclasses.replace(record, objects=tuple(record.objects[i] for i in order))


def _parse(raw: Any, *, image_root: Path, source: str, check_files: bool) -> DetectionRecord:
    if not isinstance(raw, dict):
        raise _RecordProblem("", f"a record must be a JSON object, got {_short(raw)}")
    images = raw.get("images")
    if not isinstance(images, list) or not images or not all(isinstance(p, str) and p for p in images):
        raise _RecordProblem("images", f"expected a non-empty list of image paths, got {_short(images)}")
    width, height = _positive_int(raw, "width"), _positive_int(raw, "height")
    objects = raw.get("objects")
    if not isinstance(objects, list):
        raise _RecordProblem("objects", f"expected a list (possibly empty) of objects, got {_short(objects)}")
    parsed = tuple(_object(obj, f"objects[{i}]") for i, obj in enumerate(objects))
    crowd = raw.get("crowd", [])
    if not isinstance(crowd, list):
        raise _RecordProblem("crowd", f"expected a list (possibly empty) of crowd regions, got {_short(crowd)}")
    regions = tuple(_object(obj, f"crowd[{i}]") for i, obj in enumerate(crowd))
    paths = [_image_path(name, f"images[{i}]", image_root, check_files) for i, name in enumerate(images)]
    return DetectionRecord(image_paths=tuple(paths), width=width, height=height, objects=parsed, source=source,
                           crowd=regions)


def load_records(
    jsonl_path: str | Path,
    image_root: str | Path | None = None,
    *,
    max_samples: int | None = None,
    check_files: bool = True,
    object_order: str = "keep",
) -> list[DetectionRecord]:
    """Read and validate every record (the first ``max_samples`` if given); blank lines are skipped.

    Image paths resolve against ``image_root`` if given, else the JSONL's directory; with ``check_files`` every
    image header is read (module doc); ``object_order="sorted"`` also checks each record's objects are in top-left
    order. Raises :class:`DatasetError` listing up to :data:`MAX_REPORTED_ERRORS` problems as
    ``file:line: field: message``.
    """
    path = Path(jsonl_path)
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
    if object_order not in OBJECT_ORDERS:
        raise ValueError(f"object_order must be one of {list(OBJECT_ORDERS)}, got {object_order!r}")
    shown = _printable(path)
    if "\x00" in str(path):
        raise DatasetError([f"{shown}: the path contains a NUL byte; check data.train_jsonl / data.val_jsonl"])
    try:
        is_file = path.is_file()
        root = Path(image_root).expanduser() if image_root is not None else path.parent
        root_ok = image_root is None or root.is_dir()
    except (OSError, RuntimeError) as exc:
        raise DatasetError([f"{shown}: cannot use this path ({getattr(exc, 'strerror', None) or exc}); check "
                            "data.train_jsonl / data.val_jsonl / data.image_root"]) from None
    if not is_file:
        raise DatasetError([f"{shown}: no such file ({_printable(path.resolve())}); check data.train_jsonl / "
                            "data.val_jsonl"])
    if not root_ok:
        raise DatasetError([f"{shown}: image_root {_printable(root.resolve())} is not a directory; check "
                            "data.image_root"])
    records: list[DetectionRecord] = []
    problems: list[str] = []
    total_problems = 0
    try:
        with path.open("rb") as handle:
            offset = 0
            for line_no, line in enumerate(handle, start=1):
                line_offset, offset = offset, offset + len(line)
                if max_samples is not None and len(records) + total_problems >= max_samples:
                    break
                if line_no == 1 and line.startswith(_UTF8_BOM):
                    line, line_offset = line[len(_UTF8_BOM):], line_offset + len(_UTF8_BOM)
                if not line.strip():
                    continue
                source = f"{shown}:{line_no}"
                try:
                    raw = _decode_line(line, line_offset)
                    record = _parse(raw, image_root=root, source=source, check_files=check_files)
                    if object_order == "sorted":
                        _check_sorted(record.objects)
                    records.append(record)
                except _RecordProblem as problem:
                    total_problems += 1
                    if len(problems) < MAX_REPORTED_ERRORS:
                        problems.append(f"{source}: {problem}")
    except OSError as exc:
        raise DatasetError([f"{shown}: cannot read ({exc.strerror or exc}); check the file's permissions"]) from None
    if total_problems:
        raise DatasetError(problems, total_problems)
    if not records:
        raise DatasetError([f"{shown}: contains no records; write one JSON object per line"])
    return records


def _decode_line(line: bytes, file_offset: int) -> Any:
    """One JSONL line -> its JSON value; bad UTF-8, bad JSON and over-deep nesting become a problem of the line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _RecordProblem("", f"not valid UTF-8: byte 0x{line[exc.start]:02x} at byte {exc.start + 1} of the line "
                                 f"(file offset {file_offset + exc.start}); save the file as UTF-8") from None
    try:
        return untrusted_json.loads(text)
    except json.JSONDecodeError as exc:
        raise _RecordProblem("", f"not valid JSON ({exc.msg} at column {exc.colno}); each line must hold one "
                                 "complete JSON object") from None
    except RecursionError:
        raise _RecordProblem("", "JSON nested too deeply to read; a record is an object of lists of objects") from None
