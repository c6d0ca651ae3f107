"""Post-rollout packing (docs/design.md, decision 8): the buffered ``Y_train`` segments of the next packed forward.

A segment is atomic. The selection always includes the oldest buffered segment (no starvation), fits
``packing_length``, never totals less than the FIFO-greedy baseline, and is deterministic. Leftovers stay in a
rank-local carry buffer for the next step (carry-only mode: no flush steps); a step whose segments need several rows
trains them all (:meth:`CarryBuffer.pop_rows`), so the carry never outgrows one step's segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Sequence, TypeVar

from coordexp.errors import MissingDependencyError, UserInputError

__all__ = ["fifo_greedy_selection", "select_segments", "PackedSelection", "CarryBuffer", "PackingLimitError"]

T = TypeVar("T")


class PackingLimitError(UserInputError, ValueError):
    """A segment longer than a packed row, or more segments than the carry buffer holds; the message names the
    limit and its mitigations (the user changes a config value)."""


def _import_binpacking():
    try:
        import binpacking
    except ImportError as exc:
        raise MissingDependencyError(
            "post-rollout packing selection needs the 'binpacking' package, which is not installed. "
            "Install it (pip install binpacking) or set training.packing: false.",
            hint="pip install binpacking",
        ) from exc
    return binpacking


def _check_length(length: object, where: str) -> int:
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"{where}: a segment length must be a positive int encoded_len (got {length!r})")
    return length


def fifo_greedy_selection(lengths: Sequence[int], capacity: int) -> list[int]:
    """The FIFO-greedy baseline: scan in insertion order and take every segment that still fits.

    Segments that do not fit are skipped (the scan goes on), so this baseline is at least as full as the
    stricter "stop at the first segment that does not fit" variant; beating it beats both.
    """
    selected, total = [], 0
    for index, length in enumerate(lengths):
        if total + length <= capacity:
            selected.append(index)
            total += length
    return selected


def select_segments(lengths: Sequence[int], capacity: int) -> list[int]:
    """Indices (ascending insertion order) of the buffered segments to pack into one forward of ``capacity``.

    Candidates are the FIFO-greedy baseline and, for each bin of ``binpacking.to_constant_volume`` over the
    other segments with the residual capacity ``capacity - lengths[0]``, the oldest plus that bin. The best
    candidate has the largest total; ties go to fewer segments, then to the lexicographically smallest index
    tuple. Deterministic for identical inputs.

    Raises:
        MissingDependencyError: ``binpacking`` is not installed (install it or set ``training.packing: false``).
        PackingLimitError: the oldest segment is over capacity (a config limit, with its mitigations).
        ValueError: empty buffer, a non-positive length or capacity.
    """
    binpacking = _import_binpacking()
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"packing capacity must be a positive int packing_length (got {capacity!r})")
    if not lengths:
        raise ValueError("select_segments needs at least one buffered segment (the buffer is empty)")
    lengths = [_check_length(length, f"segment {i}") for i, length in enumerate(lengths)]
    if lengths[0] > capacity:
        raise PackingLimitError(
            f"the oldest segment (encoded_len={lengths[0]}) exceeds packing_length={capacity}; it can never be "
            "packed. Increase global_max_length, reduce rollout_matching.max_new_tokens, or set "
            "training.packing: false."
        )
    candidates = [fifo_greedy_selection(lengths, capacity)]
    residual = capacity - lengths[0]
    others = {i: length for i, length in enumerate(lengths) if i > 0 and length <= residual}
    if others:
        for bin_ in binpacking.to_constant_volume(others, residual):
            candidates.append([0, *sorted(bin_)])

    def rank(candidate: list[int]) -> tuple[int, int, tuple[int, ...]]:
        return (-sum(lengths[i] for i in candidate), len(candidate), tuple(candidate))

    return min(candidates, key=rank)


@dataclass(frozen=True)
class PackedSelection(Generic[T]):
    """Segments popped for one packed forward, oldest first, with the fill of ``packing_length``."""

    items: tuple[T, ...]
    lengths: tuple[int, ...]
    total_length: int
    fill_ratio: float
    remaining: int  # segments left in the carry buffer after the pop


class CarryBuffer(Generic[T]):
    """Rank-local FIFO of pending segments; every rejected insertion leaves the buffer unchanged."""

    def __init__(self, packing_length: int, max_segments: int) -> None:
        for name, value in (
            ("packing_length", packing_length),
            ("max_segments (training.packing_buffer)", max_segments),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int when packing is enabled (got {value!r})")
        _import_binpacking()  # fail at trainer set-up, not at the first pop
        self.packing_length = packing_length
        self.max_segments = max_segments
        self._items: list[T] = []
        self._lengths: list[int] = []

    def __len__(self) -> int:
        return len(self._items)

    @property
    def total_length(self) -> int:
        """Sum of the buffered segments' encoded lengths."""
        return sum(self._lengths)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Encoded lengths in insertion order."""
        return tuple(self._lengths)

    def _validate(self, lengths: list[object]) -> list[int]:
        checked = [_check_length(length, f"segment {len(self) + i}") for i, length in enumerate(lengths)]
        for length in checked:
            if length > self.packing_length:
                raise PackingLimitError(
                    f"post-rollout packing cannot fit a single segment: encoded_len={length} > "
                    f"packing_length={self.packing_length}. Mitigations: increase global_max_length, reduce "
                    "rollout_matching.max_new_tokens, or set training.packing: false."
                )
        if len(self) + len(checked) > self.max_segments:
            raise PackingLimitError(
                f"post-rollout packing carry buffer overflow: {len(self)} buffered + {len(checked)} new segment(s) "
                f"> training.packing_buffer={self.max_segments}. Mitigations: reduce the per-device batch size or "
                "increase training.packing_buffer."
            )
        return checked

    def add(self, item: T, length: int) -> None:
        """Append one segment; raises before mutating if it is oversized or would overflow the buffer."""
        self.add_many([(item, length)])

    def add_many(self, entries: Iterable[tuple[T, int]]) -> None:
        """Append several segments in order, all or nothing."""
        entries = list(entries)
        checked = self._validate([length for _, length in entries])
        self._items.extend(item for item, _ in entries)
        self._lengths.extend(checked)

    def drop_where(self, predicate: Callable[[T], bool]) -> list[T]:
        """Remove and return every buffered segment ``predicate`` accepts (in order); the rest keep their order."""
        keep = [not predicate(item) for item in self._items]
        dropped = [item for item, k in zip(self._items, keep) if not k]
        self._items = [item for item, k in zip(self._items, keep) if k]
        self._lengths = [length for length, k in zip(self._lengths, keep) if k]
        return dropped

    def pop_packed(self) -> PackedSelection[T]:
        """Remove and return the :func:`select_segments` choice, oldest first; the rest stays buffered."""
        if not self._items:
            raise ValueError("cannot pop a packed forward from an empty carry buffer; add segments first")
        chosen = select_segments(self._lengths, self.packing_length)
        chosen_set = set(chosen)
        items = tuple(self._items[i] for i in chosen)
        lengths = tuple(self._lengths[i] for i in chosen)
        self._items = [item for i, item in enumerate(self._items) if i not in chosen_set]
        self._lengths = [length for i, length in enumerate(self._lengths) if i not in chosen_set]
        total = sum(lengths)
        return PackedSelection(items, lengths, total, total / self.packing_length, len(self._items))

    def pop_rows(self, keep_at_most: int) -> list[PackedSelection[T]]:
        """The packed rows of one step: one :meth:`pop_packed` row, then more while a full row's worth of tokens or
        more than ``keep_at_most`` segments stay buffered. With ``keep_at_most`` = the segments this step added,
        the carry never holds more than one step produced, so it cannot grow step after step (steady state)."""
        if isinstance(keep_at_most, bool) or not isinstance(keep_at_most, int) or keep_at_most < 0:
            raise ValueError(f"keep_at_most must be a non-negative int (got {keep_at_most!r})")
        rows = [self.pop_packed()]
        while self._items and (self.total_length >= self.packing_length or len(self._items) > keep_at_most):
            rows.append(self.pop_packed())
        return rows
