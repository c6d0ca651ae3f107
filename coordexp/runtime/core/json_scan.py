"""The byte-level JSON scanner behind :func:`coordexp.runtime.core.parsing.parse_rollout`.

It lexes the decoded bytes of a rollout and fills one :class:`_Entry` per top-level entry; lexemes map back to
tokens through the byte offsets of the pieces. A canonical entry is matched whole by one regex
(``_FAST_ENTRY_RE``, completed in a batch by the parser); any other goes through the general recursive scan,
which judges every schema problem without repairing anything.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from functools import cached_property

import numpy as np

_COORD_TEXT_RE = re.compile(rb"<\|coord_[0-9]{1,4}\|>")
_LITERAL_RE = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_STRING = rb'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'
_LEX_RE = re.compile(
    rb"[ \t\n\r]*(?:([{}\[\],:])|(" + _STRING + rb'")|([^ \t\n\r{}\[\],:"]+)|(\Z)|("))'
)
_OPEN_STRING_TO_END_RE = re.compile(_STRING + rb"(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z")
_WS_RE = re.compile(rb"[ \t\n\r]*")
_PUNCT, _STR, _OTHER, _END, _QUOTE = 1, 2, 3, 4, 5
_LBRACE, _RBRACE, _LBRACK, _RBRACK, _COMMA, _COLON = b"{}[],:"
_MAX_DEPTH = 64

# Fast path for the common, well-formed entry: ``"object_N": {...}`` whose body is exactly desc + one flat/pair
# geometry array of coord items, in either field order, plus the separator after it. The parser completes all such
# entries in one vectorised batch; one whose items are not exactly one coord token each takes the general path.
_W = rb"[ \t\n\r]*"
_ITEM = rb'(?:"<\|coord_[0-9]{1,4}\|>"|<\|coord_[0-9]{1,4}\|>)'
_FLAT = rb"\[" + _W + _ITEM + rb"(?:" + _W + rb"," + _W + _ITEM + rb")*" + _W + rb"\]"
_PAIR = rb"\[" + _W + _ITEM + _W + rb"," + _W + _ITEM + _W + rb"\]"
_PAIRS = rb"\[" + _W + _PAIR + rb"(?:" + _W + rb"," + _W + _PAIR + rb")*" + _W + rb"\]"


def _desc_field(n: int) -> bytes:
    return rb'"desc"' + _W + rb":" + _W + rb"(?P<desc%d>" % n + _STRING + rb'")'


def _geom_field(n: int) -> bytes:
    return (rb'"(?P<geom%d>bbox_2d|poly)"' % n + _W + rb":" + _W
            + rb"(?P<arr%d>(?P<flat%d>" % (n, n) + _FLAT + rb")|" + _PAIRS + rb")")


_FAST_ENTRY_RE = re.compile(
    _W + rb'(?P<key>"object_(?P<index>[0-9]+)")' + _W + rb":" + _W + rb"(?P<body>\{" + _W
    + rb"(?:" + _desc_field(1) + _W + rb"," + _W + _geom_field(1)
    + rb"|" + _geom_field(2) + _W + rb"," + _W + _desc_field(2) + rb")"
    + _W + rb"\})(?:" + _W + rb"(?P<sep>[,}]))?"
)


class _Truncated(Exception):
    """The text ended inside a JSON value."""


class _Malformed(Exception):
    """A syntax error: nothing from here on can stay in a prefix that must remain valid JSON."""


class _Entry:
    """A top-level entry while it is being scanned (mutable scratch; becomes a ParsedObject if retained)."""

    __slots__ = ("key", "index", "start", "end", "is_dict", "reasons", "desc", "desc_inner", "geometry",
                 "shapes", "bins", "coord_toks", "n_slots", "bbox_pairs")

    def __init__(self, key: str, index: int | None, start: int) -> None:
        self.key, self.index, self.start = key, index, start
        self.end = -1
        self.is_dict = False
        self.reasons: set[str] = set()
        self.desc: str | None = None
        self.desc_inner: tuple[int, int] | None = None
        self.geometry: str | None = None
        self.shapes: list[int] = []  # per top-level geometry element: 1 scalar, 2 pair, 0 anything else
        self.bins: list[int] = []
        self.coord_toks: list[int] = []
        self.n_slots = 0


class _Scanner:
    """The decoded bytes and, per token, byte starts, bins (-1: not a coord token) and coord counts.

    Arrays feed the vectorised fast path; the general path's per-lexeme lookups use lists, built on first use.
    """

    def __init__(self, text: bytes, starts: np.ndarray, bins: np.ndarray, coord_cum: np.ndarray, coord_at: np.ndarray):
        self.text = text
        self.starts_arr, self.bins_arr = starts, bins  # (T + 1,) byte offsets; (T,) bins
        self.coord_cum_arr, self.coord_at_arr = coord_cum, coord_at  # coord tokens before each token; positions

    @cached_property
    def starts(self) -> list[int]:
        return self.starts_arr.tolist()

    @cached_property
    def bins(self) -> list[int]:
        return self.bins_arr.tolist()

    @cached_property
    def coord_cum(self) -> list[int]:
        return self.coord_cum_arr.tolist()

    def tok(self, pos: int) -> int:
        """Index of the token holding byte ``pos``."""
        return bisect_right(self.starts, pos) - 1

    # -- lexing ---------------------------------------------------------------------------------------------
    def lex(self, pos: int) -> tuple[int, int, int]:
        m = _LEX_RE.match(self.text, pos)
        kind = m.lastindex
        start, end = m.span(kind)
        if kind == _QUOTE:
            if _OPEN_STRING_TO_END_RE.match(self.text, start):
                raise _Truncated
            raise _Malformed
        if kind == _OTHER and end == len(self.text):
            raise _Truncated  # a bare value running into the end may still have been growing
        return kind, start, end

    def fail(self, kind: int) -> None:
        raise _Truncated if kind == _END else _Malformed

    def expect(self, pos: int, char: int) -> int:
        kind, start, end = self.lex(pos)
        if kind != _PUNCT or self.text[start] != char:
            self.fail(kind)
        return end

    def coord_bin_at(self, start: int, end: int) -> int:
        """Bin of the single coord token spanning exactly ``[start, end)``, else -1."""
        if end <= start:
            return -1
        tok = self.tok(start)
        if self.starts[tok] != start or self.starts[tok + 1] != end:
            return -1
        return self.bins[tok]

    def check_bare(self, start: int, end: int) -> None:
        """A bare (unquoted) value must be a JSON literal or a coord token (CoordJSON); anything else is syntax."""
        if _LITERAL_RE.fullmatch(self.text, start, end) or _COORD_TEXT_RE.fullmatch(self.text, start, end):
            return
        raise _Malformed

    # -- generic values -------------------------------------------------------------------------------------
    def skip_value(self, lexeme: tuple[int, int, int], depth: int = 0) -> int:
        kind, start, end = lexeme
        if kind == _STR:
            return end
        if kind == _OTHER:
            self.check_bare(start, end)
            return end
        if kind == _PUNCT and self.text[start] in (_LBRACE, _LBRACK):
            return self.skip_container(end, self.text[start] == _LBRACE, depth + 1)
        self.fail(kind)

    def skip_container(self, pos: int, is_dict: bool, depth: int) -> int:
        if depth > _MAX_DEPTH:
            raise _Malformed
        close = _RBRACE if is_dict else _RBRACK
        kind, start, end = self.lex(pos)
        if kind == _PUNCT and self.text[start] == close:
            return end
        while True:
            if is_dict:
                if kind != _STR:
                    self.fail(kind)
                kind, start, end = self.lex(self.expect(end, _COLON))
            pos = self.skip_value((kind, start, end), depth)
            kind, start, end = self.lex(pos)
            if kind == _PUNCT and self.text[start] == _COMMA:
                kind, start, end = self.lex(end)
                continue
            if kind == _PUNCT and self.text[start] == close:
                return end
            self.fail(kind)

    # -- objects --------------------------------------------------------------------------------------------
    def object_body(self, pos: int, entry: _Entry) -> int:
        """Scan ``{...}`` after its ``{``; fills ``entry``; returns the position after the closing ``}``."""
        text = self.text
        kind, start, end = self.lex(pos)
        if kind == _PUNCT and text[start] == _RBRACE:
            return end
        while True:
            if kind != _STR:
                self.fail(kind)
            name = _decode_string(text, start, end)
            value = self.lex(self.expect(end, _COLON))
            if name == "desc":
                if entry.desc is not None or entry.desc_inner is not None or "bad_desc_type" in entry.reasons:
                    entry.reasons.add("duplicate_desc")
                if value[0] == _STR:
                    pos = value[2]
                    entry.desc = _decode_string(text, value[1], value[2])
                    entry.desc_inner = (value[1] + 1, value[2] - 1)
                else:
                    pos = self.skip_value(value)
                    entry.reasons.add("bad_desc_type")
            elif name in ("bbox_2d", "poly"):
                if entry.geometry is not None:
                    entry.reasons.add("multiple_geometry")
                entry.geometry = name
                if value[0] == _PUNCT and text[value[1]] == _LBRACK:
                    pos = self.geometry_array(value[2], entry)
                else:
                    pos = self.skip_value(value)
                    entry.reasons.add("non_coord_value")
            else:
                pos = self.skip_value(value)
                entry.reasons.add("unknown_key")
            kind, start, end = self.lex(pos)
            if kind == _PUNCT and text[start] == _COMMA:
                kind, start, end = self.lex(end)
                continue
            if kind == _PUNCT and text[start] == _RBRACE:
                return end
            self.fail(kind)

    def scalar(self, lexeme: tuple[int, int, int], entry: _Entry) -> int:
        """One coordinate slot: a coord token, bare or quoted; anything else marks the object invalid."""
        kind, start, end = lexeme
        if kind == _STR:
            inner_start, inner_end = start + 1, end - 1
        elif kind == _OTHER:
            inner_start, inner_end = start, end
        else:
            end = self.skip_value(lexeme)  # raises for non-values; a nested dict is valid JSON but no coordinate
            entry.reasons.add("non_coord_value")
            return end
        entry.n_slots += 1
        value = self.coord_bin_at(inner_start, inner_end)
        if value >= 0:
            entry.bins.append(value)
            entry.coord_toks.append(self.tok(inner_start))
        elif _COORD_TEXT_RE.fullmatch(self.text, inner_start, inner_end):
            entry.reasons.add("ambiguous_alignment")  # coord text that is not exactly one coord token
        elif kind == _OTHER:
            self.check_bare(start, end)
            entry.reasons.add("non_coord_value")
        else:
            entry.reasons.add("non_coord_value")
        return end

    def geometry_array(self, pos: int, entry: _Entry) -> int:
        text = self.text
        kind, start, end = self.lex(pos)
        if kind == _PUNCT and text[start] == _RBRACK:
            return end
        while True:
            if kind == _PUNCT and text[start] == _LBRACK:
                pos = self.pair(end, entry)
            else:
                entry.shapes.append(1 if kind in (_STR, _OTHER) else 0)
                pos = self.scalar((kind, start, end), entry)
            kind, start, end = self.lex(pos)
            if kind == _PUNCT and text[start] == _COMMA:
                kind, start, end = self.lex(end)
                continue
            if kind == _PUNCT and text[start] == _RBRACK:
                return end
            self.fail(kind)

    def pair(self, pos: int, entry: _Entry) -> int:
        """A nested ``[x, y]`` point; anything but exactly two scalars is ``bad_nesting``."""
        text = self.text
        count = 0
        kind, start, end = self.lex(pos)
        if not (kind == _PUNCT and text[start] == _RBRACK):
            while True:
                if kind in (_STR, _OTHER):
                    self.scalar((kind, start, end), entry)
                    pos = end
                else:
                    pos = self.skip_value((kind, start, end))
                    entry.reasons.add("bad_nesting")
                count += 1
                kind, start, end = self.lex(pos)
                if kind == _PUNCT and text[start] == _COMMA:
                    kind, start, end = self.lex(end)
                    continue
                if kind == _PUNCT and text[start] == _RBRACK:
                    break
                self.fail(kind)
        entry.shapes.append(2 if count == 2 else 0)
        return end


def _decode_string(text: bytes, start: int, end: int) -> str:
    raw = text[start + 1 : end - 1]
    if b"\\" not in raw:
        return raw.decode("utf-8", "replace")
    import json

    return json.loads(text[start:end].decode("utf-8", "replace"))
