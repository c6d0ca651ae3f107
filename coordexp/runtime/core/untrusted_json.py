"""JSON from users' files: integer literals too long to be any valid value stay unconverted, so every reader reports
them as a problem of their record (``int()`` of thousands of digits raises, of millions is slow; ``float()`` of 309
digits overflows). Shared by the JSONL data loader and ``coordexp convert``."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_NUMBER_DIGITS", "LongNumber", "parse_int", "loads"]

MAX_NUMBER_DIGITS = 20  # longer integer literals are no id, size or coordinate: refused before int()


class LongNumber:
    """An integer literal of more than :data:`MAX_NUMBER_DIGITS` digits, kept unconverted: no check accepts it, and
    messages show only its length."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"<a {self.digits}-digit number>"


def parse_int(text: str) -> int | LongNumber:
    return LongNumber(text) if len(text) > MAX_NUMBER_DIGITS + 1 else int(text)


def loads(text: str) -> Any:
    """``json.loads`` with :func:`parse_int`; ``RecursionError`` (nesting deeper than the reader recurses) passes
    through for the caller to word as its own problem."""
    return json.loads(text, parse_int=parse_int)
