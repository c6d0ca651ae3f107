"""JSONL detection records -> validated :class:`DetectionRecord` objects.

One record per line: ``{"images": [path], "width", "height", "objects": [{"desc", "bbox_2d" | "poly"}]}`` with
norm1000 coordinates (ints 0..999 or ``"<|coord_k|>"`` strings). A bad record fails the whole load with
``file:line: field: problem`` and a fix, listing the first several problems at once; the trainer never meets a
record it would silently misread. Other top-level keys (ids, metadata) are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.tokens import NUM_COORD_BINS, parse_coord_token

__all__ = ["DetectionRecord", "DatasetError", "load_records", "parse_record", "MAX_REPORTED_ERRORS"]

MAX_REPORTED_ERRORS = 10
_OBJECT_KEYS = frozenset({"desc", "bbox_2d", "poly"})


@dataclass(frozen=True)
class DetectionRecord:
    """One image (or several) with its ground-truth objects; ``source`` is ``"file:line"`` for error messages."""

    image_paths: tuple[Path, ...]
    width: int
    height: int
    objects: tuple[DetObject, ...]
    source: str


class DatasetError(ValueError):
    """A JSONL file cannot be used; ``problems`` holds one ``file:line: field: message`` line per problem."""

    def __init__(self, problems: list[str], total: int | None = None):
        self.problems = tuple(problems)
        total = len(problems) if total is None else total
        more = f"\n  ... and {total - len(problems)} more" if total > len(problems) else ""
        head = f"{total} problem(s) in the dataset:" if total > 1 else "dataset problem:"
        super().__init__(head + "".join(f"\n  {p}" for p in problems) + more)


class _RecordProblem(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)


def _coord(value: Any, field: str) -> int:
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
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
    has_box, has_poly = "bbox_2d" in raw, "poly" in raw
    if has_box == has_poly:
        which = "both" if has_box else "neither"
        raise _RecordProblem(field, f"has {which} of \"bbox_2d\" and \"poly\"; give exactly one geometry")
    if has_box:
        return DetObject(desc=desc.strip(), geometry="bbox_2d", coords=_bbox(raw["bbox_2d"], f"{field}.bbox_2d"))
    return DetObject(desc=desc.strip(), geometry="poly", coords=_poly(raw["poly"], f"{field}.poly"))


def _positive_int(raw: dict, key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _RecordProblem(key, f"expected a positive integer (image {key} in pixels), got {_short(value)}")
    return value


def parse_record(raw: Any, *, image_root: Path, source: str, check_files: bool = True) -> DetectionRecord:
    """Validate one decoded JSON line; raises :class:`DatasetError` with ``source`` and the field path."""
    try:
        return _parse(raw, image_root=image_root, source=source, check_files=check_files)
    except _RecordProblem as problem:
        raise DatasetError([f"{source}: {problem}"]) from None


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
    paths = []
    for i, name in enumerate(images):
        path = Path(name).expanduser()
        path = path if path.is_absolute() else image_root / path
        if check_files and not path.is_file():
            raise _RecordProblem(f"images[{i}]", f"image file not found: {path.resolve()} (relative paths resolve "
                                                 f"against {image_root}; set data.image_root if the images live "
                                                 "elsewhere)")
        paths.append(path)
    return DetectionRecord(image_paths=tuple(paths), width=width, height=height, objects=parsed, source=source)


def load_records(
    jsonl_path: str | Path,
    image_root: str | Path | None = None,
    *,
    max_samples: int | None = None,
    check_files: bool = True,
) -> list[DetectionRecord]:
    """Read and validate every record (the first ``max_samples`` if given); blank lines are skipped.

    Image paths resolve against ``image_root`` if given, else the JSONL's directory. Raises :class:`DatasetError`
    listing up to :data:`MAX_REPORTED_ERRORS` problems as ``file:line: field: message``.
    """
    path = Path(jsonl_path)
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
    if not path.is_file():
        raise DatasetError([f"{path}: no such file ({path.resolve()}); check data.train_jsonl / data.val_jsonl"])
    root = Path(image_root).expanduser() if image_root is not None else path.parent
    if image_root is not None and not root.is_dir():
        raise DatasetError([f"{path}: image_root {root.resolve()} is not a directory; check data.image_root"])
    records: list[DetectionRecord] = []
    problems: list[str] = []
    total_problems = 0
    with path.open("r", encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if max_samples is not None and len(records) + total_problems >= max_samples:
                break
            if not line.strip():
                continue
            source = f"{path}:{line_no}"
            try:
                raw = json.loads(line)
                records.append(_parse(raw, image_root=root, source=source, check_files=check_files))
            except json.JSONDecodeError as exc:
                total_problems += 1
                if len(problems) < MAX_REPORTED_ERRORS:
                    problems.append(f"{source}: not valid JSON ({exc.msg} at column {exc.colno}); each line must "
                                    "hold one complete JSON object")
            except _RecordProblem as problem:
                total_problems += 1
                if len(problems) < MAX_REPORTED_ERRORS:
                    problems.append(f"{source}: {problem}")
    if total_problems:
        raise DatasetError(problems, total_problems)
    if not records:
        raise DatasetError([f"{path}: contains no records; write one JSON object per line"])
    return records
