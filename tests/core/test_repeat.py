"""The pure repeat guard: hand-computed cases, schema/JSON construction, and properties of the incremental tracker."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.repeat import (
    RepeatGuard,
    RepeatTracker,
    count_object_keys,
    should_terminate,
    trailing_run_length,
)
from coordexp.schema.rollout import RepeatTerminateConfig

# a toy byte vocabulary in which '"object_' is split over three ids, as real tokenizers split it
PIECES = (b'{"', b"object", b"_", b"1", b'": ', b"x", b", ", b'"', b"object_", b"}")
OPEN, OBJECT, UNDERSCORE, ONE, COLON, X, COMMA, QUOTE, OBJECT_UNDERSCORE, CLOSE = range(len(PIECES))


def guard(**overrides) -> RepeatGuard:
    values = dict(enabled=True, min_new_tokens=0, max_consecutive_token_repeats=0, ngram_size=0, ngram_repeats=0,
                  max_object_keys=0)
    values.update(overrides)
    return RepeatGuard(**values)


def test_consecutive_repeats_trip_at_exactly_the_threshold():
    g = guard(max_consecutive_token_repeats=3)
    assert not should_terminate([5, 7, 7], g)
    assert should_terminate([5, 7, 7, 7], g)
    assert not should_terminate([7, 7, 5], g)  # the run must be trailing
    assert trailing_run_length([5, 7, 7, 7]) == 3 and trailing_run_length([]) == 0


def test_ngram_must_repeat_back_to_back_at_the_end():
    g = guard(ngram_size=2, ngram_repeats=3)
    assert should_terminate([9, 1, 2, 1, 2, 1, 2], g)
    assert not should_terminate([1, 2, 1, 2], g)  # only twice
    assert not should_terminate([1, 2, 1, 2, 0, 1, 2], g)  # three times, not back-to-back
    assert should_terminate([1, 2, 1, 2, 1, 2, 1], g)  # (2, 1) three times: a shifted cycle counts too
    assert not should_terminate([1, 2, 1, 2, 1, 2, 3], g)  # the last bigram (2, 3) is new


def test_min_new_tokens_holds_every_threshold_back():
    g = guard(min_new_tokens=6, max_consecutive_token_repeats=2)
    assert not should_terminate([4, 4, 4, 4, 4], g)
    assert should_terminate([4, 4, 4, 4, 4, 4], g)


def test_object_keys_counted_on_bytes_across_token_boundaries():
    ids = [OPEN, OBJECT, UNDERSCORE, ONE, COLON, X, COMMA, QUOTE, OBJECT_UNDERSCORE, ONE, COLON, X]
    assert count_object_keys(ids, PIECES) == 2
    g = guard(max_object_keys=1)
    assert not should_terminate(ids[:8], g, object_key_count=count_object_keys(ids[:8], PIECES))
    assert should_terminate(ids, g, object_key_count=2)  # a second object opened: more than 1


def test_disabled_or_zero_thresholds_never_fire():
    repeated = [3] * 50
    assert not should_terminate(repeated, guard(enabled=False, max_consecutive_token_repeats=2))
    assert not should_terminate(repeated, guard())
    assert not guard().active and guard(ngram_size=2, ngram_repeats=2).active
    assert not guard(enabled=False, max_consecutive_token_repeats=2).active


def test_schema_defaults_and_json_subtree_build_the_same_guard():
    cfg = RepeatTerminateConfig(enabled=True, max_object_keys=None)
    assert RepeatGuard.from_config(cfg) == RepeatGuard(True, 256, 64, 64, 2, 0)
    payload = json.dumps({"enabled": True, "min_new_tokens": 4, "max_consecutive_token_repeats": 8,
                          "ngram_size": 3, "ngram_repeats": 2, "max_object_keys": 20})
    assert RepeatGuard.from_json(payload) == RepeatGuard(True, 4, 8, 3, 2, 20)
    with pytest.raises(Exception, match="unknown_knob"):
        RepeatGuard.from_json({"enabled": True, "unknown_knob": 1})


def test_invalid_thresholds_are_rejected_with_the_key_name():
    with pytest.raises(ValueError, match="min_new_tokens"):
        RepeatGuard(enabled=True, min_new_tokens=-1)
    with pytest.raises(ValueError, match="ngram_repeats must be >= 2"):
        RepeatGuard(enabled=True, ngram_size=4, ngram_repeats=1)


def test_tracker_needs_pieces_only_to_count_object_keys():
    with pytest.raises(ValueError, match="pieces"):
        RepeatTracker(guard(max_object_keys=3))
    RepeatTracker(guard(max_consecutive_token_repeats=3))


guards = st.builds(
    guard,
    min_new_tokens=st.integers(0, 8),
    max_consecutive_token_repeats=st.integers(0, 5),
    ngram_size=st.integers(0, 4),
    ngram_repeats=st.sampled_from([0, 2, 3]),
    max_object_keys=st.integers(0, 3),
)
sequences = st.lists(st.integers(0, len(PIECES) - 1), max_size=40)


@settings(max_examples=300, deadline=None)
@given(g=guards, ids=sequences)
def test_tracker_agrees_with_the_pure_function_on_every_prefix(g, ids):
    tracker = RepeatTracker(g, PIECES)
    for end, token_id in enumerate(ids, start=1):
        prefix = ids[:end]
        assert tracker.push(token_id) == should_terminate(
            prefix, g, object_key_count=count_object_keys(prefix, PIECES))
        assert tracker.object_key_count == (count_object_keys(prefix, PIECES) if g.max_object_keys else 0)


def _reference(ids, g, key_count):
    """The guard written from its definition, independently of the implementation."""
    if not g.enabled or len(ids) < g.min_new_tokens:
        return False
    n = g.max_consecutive_token_repeats
    by_run = n > 0 and len(ids) >= n and len(set(ids[len(ids) - n:])) == 1
    s, k = g.ngram_size, g.ngram_repeats
    by_ngram = s > 0 and k > 0 and len(ids) >= s * k and all(
        ids[len(ids) - s * (r + 1): len(ids) - s * r] == ids[len(ids) - s:] for r in range(k))
    return by_run or by_ngram or (g.max_object_keys > 0 and key_count > g.max_object_keys)


@settings(max_examples=300, deadline=None)
@given(g=guards, ids=sequences)
def test_pure_function_matches_the_definition(g, ids):
    count = count_object_keys(ids, PIECES)
    assert should_terminate(ids, g, object_key_count=count) == _reference(ids, g, count)


@settings(max_examples=100, deadline=None)
@given(g=guards, ids=sequences, token=st.integers(0, len(PIECES) - 1))
def test_appending_a_run_long_enough_always_fires(g, ids, token):
    if not g.max_consecutive_token_repeats:
        return
    tail = ids + [token] * max(g.max_consecutive_token_repeats, g.min_new_tokens)
    assert should_terminate(tail, g, object_key_count=count_object_keys(tail, PIECES))
