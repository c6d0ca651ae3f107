"""Ground-truth serialization in the decision-3 assistant format, and the FN append fragment (SerializeAppend).

One line, ``", "`` and ``": "`` separators, keys ``object_n``, quoted coord tokens, flat polygons, desc JSON-escaped
(unicode kept), fields in ``object_field_order``. Byte spans of desc values and coord tokens are tracked while
rendering, so the targets builder can find their tokens without searching text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from coordexp.runtime.core.objects import DetObject

FieldOrder = Literal["desc_first", "geometry_first"]
FIELD_ORDERS: tuple[str, ...] = ("desc_first", "geometry_first")
_MARKUP_RE = re.compile(r"<\|[^|<>]*\|>")


@dataclass(frozen=True)
class RenderedAppend:
    """An append fragment and where its parts are, as UTF-8 byte offsets into ``text``.

    ``segments`` are the texts between coord tokens (``len(coord_spans) + 1`` of them): since coord tokens are added
    tokens, the tokenizer encodes each segment on its own, which lets encodings of repeated segments be cached.
    """

    text: str
    desc_spans: tuple[tuple[int, int], ...]  # desc value without its quotes, one per object
    coord_spans: tuple[tuple[int, int, int], ...]  # (bin, start, end) of each coord token, in order
    geometries: tuple[str, ...]  # geometry key of each object, in order
    segments: tuple[str, ...]
    entry_spans: tuple[tuple[int, int], ...] = ()  # each object's entry, its leading ", " included


def validate_gt_object(obj: DetObject, where: str) -> None:
    """Fail with a clear message when a ground-truth object cannot be serialized into a parseable target."""
    if not isinstance(obj, DetObject):
        raise TypeError(f"{where}: expected a DetObject, got {type(obj).__name__}")
    if not isinstance(obj.desc, str) or not obj.desc.strip():
        raise ValueError(f"{where}: desc must be a non-empty string, got {obj.desc!r}; fix or drop this object in the data")
    if "<|" in obj.desc and _MARKUP_RE.search(obj.desc):
        raise ValueError(
            f"{where}: desc {obj.desc!r} contains special-token markup like '<|...|>', which the tokenizer would turn "
            "into a coord/special token; clean the description in the data"
        )
    coords = obj.coords
    if type(coords) is tuple and coords and set(map(type, coords)) == {int} and 0 <= min(coords) and max(coords) <= 999:
        bad = ()  # the common case (plain ints in range), checked without a per-value Python loop
    else:
        bad = [c for c in coords if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c <= 999]
    if bad:
        raise ValueError(f"{where}: coords must be ints in 0..999 (norm1000 bins); bad values {bad[:4]}")
    if obj.geometry == "bbox_2d":
        if len(coords) != 4:
            raise ValueError(f"{where}: bbox_2d needs 4 values [x1, y1, x2, y2], got {len(coords)}")
        if coords[2] < coords[0] or coords[3] < coords[1]:
            raise ValueError(f"{where}: bbox_2d {list(coords)} has x2 < x1 or y2 < y1; store boxes as [x1, y1, x2, y2]")
    elif obj.geometry == "poly":
        if len(coords) < 6 or len(coords) % 2:
            raise ValueError(f"{where}: poly needs an even number (>= 6) of values, got {len(coords)}")
    else:
        raise ValueError(f"{where}: geometry must be 'bbox_2d' or 'poly', got {obj.geometry!r}")


def _check_field_order(field_order: str) -> None:
    if field_order not in FIELD_ORDERS:
        raise ValueError(f"object_field_order must be one of {list(FIELD_ORDERS)}, got {field_order!r}")


_COORD_TEXT = tuple(f"<|coord_{k}|>" for k in range(1000))
_COORD_TEXT_LEN = np.array([len(t) for t in _COORD_TEXT], dtype=np.int64)
_COORD_SEP = '", "'  # between two quoted coord tokens
_encode_desc = json.encoder.encode_basestring  # == json.dumps(desc, ensure_ascii=False), without its per-call setup


def render_entries(
    objects: Sequence[DetObject], start_index: int, field_order: FieldOrder, *, lead: str = "", tail: str = ""
) -> RenderedAppend:
    """``lead`` + ``"object_{start_index}": {...}, ...`` + ``tail``, with spans.

    One string per object; the segments between coord tokens are collected while rendering (an object's inner
    segments are all ``'", "'``), and character offsets become byte offsets only when the text is not ASCII.
    """
    _check_field_order(field_order)
    if isinstance(start_index, bool) or not isinstance(start_index, int) or start_index < 1:
        raise ValueError(f"start_index must be an int >= 1, got {start_index!r}")
    desc_first = field_order == "desc_first"
    parts, segments = [lead], []
    size, segment = len(lead), lead  # characters written; the text since the last coord token
    desc_chars: list[tuple[int, int]] = []
    bins: list[int] = []  # every coord value, in order
    first_coord: list[int] = []  # per object: its first coord token's character offset
    n_coords: list[int] = []  # per object: its number of coord tokens
    entry_chars: list[tuple[int, int]] = []
    for i, obj in enumerate(objects):
        validate_gt_object(obj, f"object {i} of the ground truth")
        escaped = _encode_desc(obj.desc)
        key = f'{", " if i else ""}"object_{start_index + i}": {{'
        if desc_first:
            head = f'{key}"desc": {escaped}, "{obj.geometry}": ["'
            after = '"]}'
        else:
            head = f'{key}"{obj.geometry}": ["'
            after = f'"], "desc": {escaped}}}'
        coords = obj.coords
        body = _COORD_SEP.join([_COORD_TEXT[value] for value in coords])
        desc_start = size + len(key) + 9 if desc_first else size + len(head) + len(body) + 13  # after '"desc": "'
        desc_chars.append((desc_start, desc_start + len(escaped) - 2))
        first_coord.append(size + len(head))
        n_coords.append(len(coords))
        bins += coords
        segments.append(segment + head)
        segments += [_COORD_SEP] * (len(coords) - 1)
        segment = after
        parts += (head, body, after)
        entry_chars.append((size, size + len(head) + len(body) + len(after)))
        size += len(head) + len(body) + len(after)
    parts.append(tail)
    segments.append(segment + tail)
    # Coord token offsets: an object's tokens follow its first one, each token's text then '", "'.
    values = np.array(bins, dtype=np.int64)
    length = _COORD_TEXT_LEN[values]
    done = np.cumsum(length + 4) - (length + 4)  # coord texts and separators before each token (all objects)
    n = np.array(n_coords, dtype=np.int64)
    starts = done + np.repeat(np.array(first_coord, dtype=np.int64) - done[np.cumsum(n) - n], n)
    coord_bins, coord_starts, coord_ends = values.tolist(), starts.tolist(), (starts + length).tolist()
    text = "".join(parts)
    if text.isascii():
        desc_spans = tuple(desc_chars)
        coord_spans = tuple(zip(coord_bins, coord_starts, coord_ends))
        entry_spans = tuple(entry_chars)
    else:  # desc values may hold multi-byte characters: convert character offsets to byte offsets
        cuts = sorted({c for span in desc_chars + entry_chars for c in span} | set(coord_starts) | set(coord_ends))
        byte_at, done_chars, n_bytes = {}, 0, 0
        for c in cuts:
            n_bytes += len(text[done_chars:c].encode("utf-8"))
            byte_at[c], done_chars = n_bytes, c
        desc_spans = tuple((byte_at[a], byte_at[b]) for a, b in desc_chars)
        coord_spans = tuple((b, byte_at[c], byte_at[e]) for b, c, e in zip(coord_bins, coord_starts, coord_ends))
        entry_spans = tuple((byte_at[a], byte_at[b]) for a, b in entry_chars)
    return RenderedAppend(
        text=text,
        desc_spans=desc_spans,
        coord_spans=coord_spans,
        geometries=tuple(o.geometry for o in objects),
        segments=tuple(segments),
        entry_spans=entry_spans,
    )


def serialize_objects(objects: Sequence[DetObject], field_order: FieldOrder = "desc_first") -> str:
    """The full assistant text ``{"object_1": {...}, ...}`` of ground-truth objects (``{}`` when there are none)."""
    return render_entries(objects, 1, field_order, lead="{", tail="}").text


_JSON_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')


def _check_open_top_level(stripped: str) -> None:
    """An append-ready prefix is inside the still-open top-level object (depth 1, no open array or string), so
    ``prefix + append`` parses (decision 3: ``Y_train`` always parses as JSON)."""
    if not stripped.lstrip().startswith("{"):
        raise ValueError("the rollout prefix does not start with '{'; use the '{' fallback (see parse_rollout)")
    skeleton = _JSON_STRING_RE.sub("", stripped)
    if '"' in skeleton:
        raise ValueError("the rollout prefix ends inside an unterminated string; it is not append-ready")
    depth = skeleton.count("{") - skeleton.count("}")
    if depth != 1 or skeleton.count("[") != skeleton.count("]"):
        where = "closed" if depth <= 0 else "inside a nested object or array"
        raise ValueError(f"the rollout prefix is not append-ready: its top-level object is {where}; appending "
                         "after it would give invalid JSON (cut the rollout with coordexp.runtime.core.parsing."
                         "parse_rollout)")


def append_lead(prefix_text: str, n_objects: int) -> str:
    """The comma rule of SerializeAppend, from the last non-whitespace character of the decoded prefix."""
    stripped = prefix_text.rstrip()
    if not stripped:
        raise ValueError("the rollout prefix is empty; an append-ready prefix starts with '{' (use the '{' fallback)")
    last = stripped[-1]
    if last in "{},":
        _check_open_top_level(stripped)
    if last == "}":
        return ", " if n_objects else ""
    if last == "{":
        return ""
    if last == ",":
        if not n_objects:
            raise ValueError("the rollout prefix ends with ',' but there is nothing to append; closing it gives invalid JSON")
        return ""
    raise ValueError(
        f"rollout prefix is not append-ready: its last non-whitespace character is {last!r}; it must end with "
        "'{', ',' or '}' (cut the rollout with coordexp.runtime.core.parsing.parse_rollout)"
    )


def render_append(
    objects: Sequence[DetObject], start_index: int, prefix_text: str, field_order: FieldOrder = "desc_first"
) -> RenderedAppend:
    """SerializeAppend with spans: comma rule, entries numbered from ``start_index``, then the closing ``}``."""
    return render_entries(objects, start_index, field_order, lead=append_lead(prefix_text, len(objects)), tail="}")


def serialize_append(
    objects: Sequence[DetObject], start_index: int, prefix_text: str, field_order: FieldOrder = "desc_first"
) -> str:
    """The text appended to the rollout prefix: ``[", "] "object_n": {...}, ... }``."""
    return render_append(objects, start_index, prefix_text, field_order).text


_BARE_COORD_RE = re.compile(r'(?<!")(<\|coord_[0-9]{1,4}\|>)(?!")')


def loads_coord_json(text: str):
    """``json.loads`` for CoordJSON: bare coord tokens (read from rollouts, docs/design.md, decision 3) stay strings.

    A ``Y_train`` whose rollout prefix uses only quoted coord tokens is plain JSON; one that keeps bare tokens
    from the model's own output is plain JSON after this quoting.
    """
    return json.loads(_BARE_COORD_RE.sub(r'"\1"', text))
