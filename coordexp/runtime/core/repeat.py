"""The repeat guard (``rollout_matching.repeat_terminate``): when must a rollout be forced to EOS?

One pure definition, shared by every backend (the HF logits processor and the vLLM V1 logits processor), so the
same YAML subtree stops the same sequences everywhere (docs/design.md, repeat guard).
No torch: the vLLM server plugin imports this module too.

A sequence's generated ids ``g`` (prompt excluded) trip the guard when ``enabled``, ``len(g) >= min_new_tokens``
and any active threshold holds (a threshold of 0 is off):

- ``max_consecutive_token_repeats`` N: the last N ids are one id repeated (the trailing run is >= N long);
- ``ngram_size`` n with ``ngram_repeats`` k: the last ``n * k`` ids are the last n-gram repeated k times back-to-back;
- ``max_object_keys`` M: the decoded text holds MORE than M ``"object_`` key openings, i.e. the model has started
  an (M+1)-th object. Counting is on decoded BYTES, because tokenizers split the opening across ids
  (``{"`` + ``object`` + ``_``); a set of ids "containing object_" would miss it. ``>`` (not upstream's ``>=``) so
  that ``max_object_keys: M`` keeps M complete objects; the opened (M+1)-th is cut by the rollout prefix trim.

When the guard trips after id ``g[-1]``, the backend forces EOS as the next id of that sequence only.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from coordexp.schema.rollout import RepeatTerminateConfig

__all__ = [
    "OBJECT_KEY_OPENING",
    "RepeatGuard",
    "RepeatTracker",
    "count_object_keys",
    "should_terminate",
    "trailing_run_length",
]

OBJECT_KEY_OPENING = b'"object_'


@dataclass(frozen=True)
class RepeatGuard:
    """Resolved guard thresholds; 0 switches a threshold off (the YAML's ``max_object_keys: null`` becomes 0)."""

    enabled: bool = False
    min_new_tokens: int = 0
    max_consecutive_token_repeats: int = 0
    ngram_size: int = 0
    ngram_repeats: int = 0
    max_object_keys: int = 0

    def __post_init__(self) -> None:
        for name in ("min_new_tokens", "max_consecutive_token_repeats", "ngram_size", "ngram_repeats",
                     "max_object_keys"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"repeat_terminate.{name} must be an integer >= 0 (got {value!r}); 0 disables it")
        if self.ngram_size and self.ngram_repeats == 1:
            raise ValueError("repeat_terminate.ngram_repeats must be >= 2 (got 1: every n-gram occurs once); "
                             "use 0 or ngram_size: 0 to disable the n-gram check")

    @classmethod
    def from_config(cls, cfg: RepeatTerminateConfig) -> "RepeatGuard":
        """The guard of a validated ``rollout_matching.repeat_terminate`` subtree."""
        return cls(
            enabled=bool(cfg.enabled),
            min_new_tokens=int(cfg.min_new_tokens),
            max_consecutive_token_repeats=int(cfg.max_consecutive_token_repeats),
            ngram_size=int(cfg.ngram_size),
            ngram_repeats=int(cfg.ngram_repeats),
            max_object_keys=int(cfg.max_object_keys or 0),
        )

    @classmethod
    def from_json(cls, payload: str | Mapping[str, Any]) -> "RepeatGuard":
        """The guard of the full subtree as JSON (how a rollout server receives it at startup), schema-validated."""
        data = json.loads(payload) if isinstance(payload, str) else dict(payload)
        return cls.from_config(RepeatTerminateConfig.model_validate(data))

    @property
    def active(self) -> bool:
        """Whether the guard can ever fire (enabled with at least one threshold on)."""
        ngram_on = bool(self.ngram_size and self.ngram_repeats)
        return self.enabled and bool(self.max_consecutive_token_repeats or ngram_on or self.max_object_keys)


def trailing_run_length(token_ids: Sequence[int]) -> int:
    """How many times the last id repeats at the end of ``token_ids`` (0 for an empty sequence)."""
    if not token_ids:
        return 0
    last, run = token_ids[-1], 0
    for token_id in reversed(token_ids):
        if token_id != last:
            break
        run += 1
    return run


def count_object_keys(token_ids: Sequence[int], pieces: Sequence[bytes]) -> int:
    """Number of ``"object_`` openings in the decoded bytes of ``token_ids`` (``pieces[i]``: the bytes of id i)."""
    return b"".join(pieces[i] for i in token_ids).count(OBJECT_KEY_OPENING)


def _ngram_repeated(token_ids: Sequence[int], size: int, repeats: int) -> bool:
    span = size * repeats
    if len(token_ids) < span:
        return False
    tail = list(token_ids[-span:])
    return tail == tail[-size:] * repeats


def should_terminate(token_ids: Sequence[int], guard: RepeatGuard, *, object_key_count: int = 0) -> bool:
    """Whether the generated ids ``token_ids`` trip ``guard`` (then the next id must be EOS).

    ``object_key_count`` is :func:`count_object_keys` of ``token_ids`` (passed in so callers can keep it
    incrementally); it only matters when ``guard.max_object_keys`` is on.
    """
    if not guard.enabled or len(token_ids) < guard.min_new_tokens:
        return False
    if guard.max_object_keys and object_key_count > guard.max_object_keys:
        return True
    limit = guard.max_consecutive_token_repeats
    if limit and len(token_ids) >= limit and trailing_run_length(token_ids[-limit:]) >= limit:
        return True
    if guard.ngram_size and guard.ngram_repeats:
        return _ngram_repeated(token_ids, guard.ngram_size, guard.ngram_repeats)
    return False


class RepeatTracker:
    """:func:`should_terminate` kept incrementally for one sequence: O(1) work per generated id.

    The n-gram check uses that the last ``n * k`` ids are an n-gram repeated k times exactly when each of the last
    ``n * (k - 1)`` ids equals the id n positions before it; the tracker keeps the length of that trailing run.
    """

    def __init__(self, guard: RepeatGuard, pieces: Sequence[bytes] | None = None):
        if guard.enabled and guard.max_object_keys and pieces is None:
            raise ValueError("repeat_terminate.max_object_keys needs the tokenizer's byte pieces to count "
                             '"object_ keys; pass pieces=PieceTable.for_tokenizer(tokenizer).pieces')
        self.guard = guard
        self._pieces = pieces
        self.length = 0
        self.object_key_count = 0
        self._last: int | None = None
        self._run = 0
        self._window: deque[int] = deque(maxlen=max(guard.ngram_size, 1))
        self._period_run = 0
        self._tail = b""

    def push(self, token_id: int) -> bool:
        """Append one generated id; return whether the sequence now trips the guard."""
        token_id = int(token_id)
        self.length += 1
        self._run = self._run + 1 if token_id == self._last else 1
        self._last = token_id
        size = self.guard.ngram_size
        if size:
            full = len(self._window) == size
            self._period_run = self._period_run + 1 if full and self._window[0] == token_id else 0
            self._window.append(token_id)
        if self.guard.max_object_keys and self._pieces is not None:
            text = self._tail + self._pieces[token_id]
            self.object_key_count += text.count(OBJECT_KEY_OPENING)  # the tail is too short to hold one alone
            self._tail = text[-(len(OBJECT_KEY_OPENING) - 1):]
        return self.triggered

    @property
    def triggered(self) -> bool:
        """Whether the ids pushed so far trip the guard (same answer as :func:`should_terminate` on them)."""
        guard = self.guard
        if not guard.enabled or self.length < guard.min_new_tokens:
            return False
        if guard.max_object_keys and self.object_key_count > guard.max_object_keys:
            return True
        if guard.max_consecutive_token_repeats and self._run >= guard.max_consecutive_token_repeats:
            return True
        if guard.ngram_size and guard.ngram_repeats:
            return self._period_run >= guard.ngram_size * (guard.ngram_repeats - 1)
        return False
