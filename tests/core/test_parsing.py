"""Strict token-aligned rollout parsing: every scenario of spec 004's parsing / prefix-cut requirements."""

from __future__ import annotations

import dataclasses
import json

import pytest

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.parsing import SCHEMA_REASONS, parse_rollout
from coordexp.runtime.core.serialize import loads_coord_json

C = "<|coord_{}|>".format


def box(x1, y1, x2, y2, quoted=True):
    values = [C(v) for v in (x1, y1, x2, y2)]
    return "[" + ", ".join(f'"{v}"' if quoted else v for v in values) + "]"


def entry(n, desc="cat", geometry="bbox_2d", array=None, first="desc"):
    array = array or box(10, 20, 30, 40)
    fields = [f'"desc": "{desc}"', f'"{geometry}": {array}']
    if first != "desc":
        fields.reverse()
    return f'"object_{n}": {{{", ".join(fields)}}}'


@pytest.fixture()
def enc(tiny_tokenizer):
    return lambda text: tiny_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture()
def parse(tiny_tokenizer, coord_vocab):
    return lambda ids, **kw: parse_rollout(ids, tiny_tokenizer, coord_vocab, **kw)


def check_prefix_invariants(result, ids, tokenizer, coord_vocab):
    """Only the last prefix token may differ from the rollout, and the prefix is ready for an append."""
    assert list(result.prefix_ids[: result.n_kept]) == list(ids[: result.n_kept])
    assert len(result.prefix_ids) - result.n_kept <= 3
    assert result.prefix_text.rstrip()[-1] in "{}"
    assert tokenizer.decode(list(result.prefix_ids)) == result.prefix_text
    for obj in result.valid_objects:
        assert [coord_vocab.bin_of(result.prefix_ids[i]) for i in obj.coord_token_indices] == list(obj.coords)
        assert all(i < result.n_kept for i in obj.coord_token_indices)


def test_canonical_rollout_with_im_end_and_junk_after(tiny_tokenizer, coord_vocab, enc, parse):
    text = "{" + entry(1) + ", " + entry(2, "stop sign", "poly", "[" + ", ".join(f'"{C(v)}"' for v in (1, 2, 3, 4, 5, 6)) + "]") + "}"
    ids = enc(text + "<|im_end|>garbage {")
    result = parse(ids)
    assert result.stopped_at_eos and not result.truncated and result.prefix_fallback is None
    assert [(o.key, o.index, o.desc, o.geometry, o.coords, o.valid) for o in result.objects] == [
        ("object_1", 1, "cat", "bbox_2d", (10, 20, 30, 40), True),
        ("object_2", 2, "stop sign", "poly", (1, 2, 3, 4, 5, 6), True),
    ]
    assert result.max_object_index == 2
    assert result.prefix_text == text[:-1]  # only the top-level "}" is cut
    assert result.response_ids == tuple(enc(text))
    assert dict(result.dropped_by_reason) == {}
    check_prefix_invariants(result, ids, tiny_tokenizer, coord_vocab)
    assert result.objects[1].to_det_object() == DetObject("stop sign", "poly", (1, 2, 3, 4, 5, 6))


def test_endoftext_and_eos_stop_too(enc, parse):
    text = "{" + entry(1) + "}"
    assert parse(enc(text + "<|endoftext|>" + "{" + entry(2) + "}")).max_object_index == 1
    assert parse(enc(text)).stopped_at_eos is False


def test_appearance_order_is_kept(enc, parse):
    result = parse(enc("{" + entry(10, "a") + ", " + entry(2, "b") + "}"))
    assert [o.index for o in result.objects] == [10, 2]
    assert [o.desc for o in result.objects] == ["a", "b"]
    assert result.max_object_index == 10


def test_geometry_first_and_bare_coords_are_equivalent(enc, parse):
    canonical = parse(enc("{" + entry(1) + "}")).objects[0]
    for text in (
        "{" + entry(1, first="geometry") + "}",
        "{" + entry(1, array=box(10, 20, 30, 40, quoted=False)) + "}",
        "{" + entry(1, array=box(10, 20, 30, 40, quoted=False), first="geometry") + "}",
        '{"object_1":{"desc":"cat","bbox_2d":[ "' + '" ,"'.join(C(v) for v in (10, 20, 30, 40)) + '" ]}}',
    ):
        obj = parse(enc(text)).objects[0]
        assert (obj.valid, obj.desc, obj.geometry, obj.coords) == (True, "cat", "bbox_2d", canonical.coords), text


def test_polygon_pairs_equal_flat_polygons(enc, parse):
    values = (100, 110, 200, 110, 150, 300)
    flat = "[" + ", ".join(f'"{C(v)}"' for v in values) + "]"
    pairs = "[" + ", ".join(f'["{C(x)}", "{C(y)}"]' for x, y in zip(values[::2], values[1::2])) + "]"
    bare_pairs = "[" + ", ".join(f"[{C(x)}, {C(y)}]" for x, y in zip(values[::2], values[1::2])) + "]"
    for array in (flat, pairs, bare_pairs):
        obj = parse(enc("{" + entry(1, geometry="poly", array=array) + "}")).objects[0]
        assert obj.valid and obj.coords == values and len(obj.coord_token_indices) == 6


@pytest.mark.parametrize(
    "body, reason",
    [
        ('{"bbox_2d": ' + box(1, 2, 3, 4) + "}", "missing_desc"),
        ('{"desc": "  ", "bbox_2d": ' + box(1, 2, 3, 4) + "}", "empty_desc"),
        ('{"desc": 5, "bbox_2d": ' + box(1, 2, 3, 4) + "}", "bad_desc_type"),
        ('{"desc": "a", "desc": "b", "bbox_2d": ' + box(1, 2, 3, 4) + "}", "duplicate_desc"),
        ('{"desc": "a"}', "missing_geometry"),
        ("{}", "missing_desc"),
        ('{"desc": "a", "bbox_2d": ' + box(1, 2, 3, 4) + ', "poly": ' + box(1, 2, 3, 4) + "}", "multiple_geometry"),
        ('{"desc": "a", "bbox_2d": ' + box(1, 2, 3, 4) + ', "score": 0.9}', "unknown_key"),
        ('{"desc": "a", "line": ' + box(1, 2, 3, 4) + "}", "unknown_key"),
        ('{"desc": "a", "bbox_2d": ["' + C(1) + '", "' + C(2) + '", "' + C(3) + '"]}', "bbox_arity"),
        ('{"desc": "a", "bbox_2d": []}', "bbox_arity"),
        ('{"desc": "a", "bbox_2d": ' + box(5, 2, 4, 9) + "}", "bbox_invalid"),
        ('{"desc": "a", "bbox_2d": ' + box(1, 9, 4, 8) + "}", "bbox_invalid"),
        ('{"desc": "a", "poly": ' + box(1, 2, 3, 4) + "}", "poly_arity"),
        ('{"desc": "a", "poly": ["' + '", "'.join(C(v) for v in range(7)) + '"]}', "poly_arity"),
        ('{"desc": "a", "bbox_2d": [1, 2, 3, 4]}', "non_coord_value"),
        ('{"desc": "a", "bbox_2d": ["a", "' + C(1) + '", "' + C(2) + '", "' + C(3) + '"]}', "non_coord_value"),
        ('{"desc": "a", "bbox_2d": ["' + C(1) + C(2) + '", "' + C(2) + '", "' + C(3) + '", "' + C(4) + '"]}', "non_coord_value"),
        ('{"desc": "a", "bbox_2d": "' + C(1) + '"}', "non_coord_value"),
        ('{"desc": "a", "bbox_2d": [["' + C(1) + '", "' + C(2) + '"], ["' + C(3) + '", "' + C(4) + '"]]}', "bad_nesting"),
        ('{"desc": "a", "poly": [["' + C(1) + '", "' + C(2) + '", "' + C(3) + '"], ["' + C(4) + '", "' + C(5) + '", "' + C(6) + '"]]}', "bad_nesting"),
        ('{"desc": "a", "poly": ["' + C(1) + '", "' + C(2) + '", ["' + C(3) + '", "' + C(4) + '"], "' + C(5) + '", "' + C(6) + '"]}', "bad_nesting"),
        ('{"desc": "' + C(7) + '", "bbox_2d": ' + box(1, 2, 3, 4) + "}", "ambiguous_alignment"),
        ('{"desc": "a", "bbox_2d": ' + box(1, 2, 3, 4) + ', "score": "' + C(7) + '"}', "unknown_key"),
    ],
)
def test_each_schema_violation_drops_only_that_object(tiny_tokenizer, coord_vocab, enc, parse, body, reason):
    assert reason in SCHEMA_REASONS
    text = "{" + entry(1) + ', "object_2": ' + body + ", " + entry(3) + "}"
    ids = enc(text)
    result = parse(ids)
    assert [(o.index, o.valid, o.drop_reason) for o in result.objects] == [(1, True, None), (2, False, reason), (3, True, None)]
    assert dict(result.dropped_by_reason) == {reason: 1}
    assert result.max_object_index == 3 and not result.truncated
    check_prefix_invariants(result, ids, tiny_tokenizer, coord_vocab)
    assert json.loads(result.prefix_text + "}")  # schema errors keep the JSON valid, so they stay in the prefix
    with pytest.raises(ValueError, match="invalid"):
        result.objects[1].to_det_object()


def test_degenerate_box_with_equal_corners_is_valid(enc, parse):
    obj = parse(enc("{" + entry(1, array=box(7, 7, 7, 7)) + "}")).objects[0]
    assert obj.valid and obj.coords == (7, 7, 7, 7)


def test_coord_text_that_is_not_one_coord_token_is_ambiguous(tiny_tokenizer, coord_vocab, enc, parse):
    """``<|coord_5|>`` spelled with ordinary BPE pieces has no coord id: its slot cannot be aligned to a token."""
    head = enc("{" + '"object_1": {"desc": "cat", "bbox_2d": ["' + C(1) + '", "' + C(2) + '", "' + C(3) + '", "')
    spelled = enc("<|coord_5|") + enc(">")
    assert not any(coord_vocab.is_coord(i) for i in spelled)
    assert tiny_tokenizer.decode(spelled) == C(5)
    ids = head + spelled + enc('"]}, ' + entry(2) + "}")
    result = parse(ids)
    assert [(o.valid, o.drop_reason) for o in result.objects] == [(False, "ambiguous_alignment"), (True, None)]
    assert result.n_ambiguous == 1
    bare = enc('{"object_1": {"desc": "cat", "bbox_2d": [' + C(1) + ", " + C(2) + ", " + C(3) + ", ") + spelled + enc("]}}")
    assert parse(bare).objects[0].drop_reason == "ambiguous_alignment"


def test_pending_key_does_not_leak_onto_a_foreign_dict(enc, parse):
    """Upstream bug: ``"object_4": 123, "foo": {...}`` produced a fake object_4 from foo's dict."""
    result = parse(enc('{"object_4": 123, "foo": {"desc": "cat", "bbox_2d": ' + box(1, 2, 3, 4) + "}}"))
    assert [(o.index, o.valid, o.drop_reason, o.geometry) for o in result.objects] == [(4, False, "non_object_value", None)]
    assert result.valid_objects == ()
    assert dict(result.dropped_by_reason) == {"non_object_value": 1, "non_object_key": 1}
    assert result.max_object_index == 4


@pytest.mark.parametrize("key, index", [("object_07", 7), ("object_0", 0), ("object_123456789012", 123456789012)])
def test_object_keys_with_integer_suffix(enc, parse, key, index):
    result = parse(enc('{"' + key + '": {"desc": "a", "bbox_2d": ' + box(1, 2, 3, 4) + "}}"))
    assert result.objects[0].index == index and result.max_object_index == index


@pytest.mark.parametrize("key", ["object_x", "Object_1", "object_", "object_1a", "object_١", "obj_1"])
def test_other_top_level_keys_are_not_objects_and_are_counted(enc, parse, key):
    result = parse(enc('{"' + key + '": {"desc": "a", "bbox_2d": ' + box(1, 2, 3, 4) + "}, " + entry(2) + "}"))
    assert [o.index for o in result.objects] == [2]
    assert result.dropped_by_reason["non_object_key"] == 1


def test_duplicate_keys_are_separate_objects(enc, parse):
    result = parse(enc("{" + entry(2, "a") + ", " + entry(2, "b") + "}"))
    assert [(o.index, o.desc, o.valid) for o in result.objects] == [(2, "a", True), (2, "b", True)]


def test_spec_max_index_counts_invalid_objects(enc, parse):
    result = parse(enc("{" + entry(2) + ', "object_9": {"desc": "x", "bbox_2d": [1]}}'))
    assert [o.valid for o in result.objects] == [True, False]
    assert result.max_object_index == 9


def test_strings_may_hold_braces_and_escapes(enc, parse):
    result = parse(enc('{"object_1": {"desc": "a}{\\"[,]: \\u00e9 \\\\", "bbox_2d": ' + box(1, 2, 3, 4) + "}}"))
    assert result.objects[0].valid and result.objects[0].desc == 'a}{"[,]: é \\'


def test_unicode_desc_and_desc_token_positions(tiny_tokenizer, enc, parse):
    result = parse(enc('{"object_1": {"desc": "black 猫 café", "bbox_2d": ' + box(1, 2, 3, 4) + "}}"))
    ids = result.prefix_ids  # positions index the prefix (its fused last token "]}} was shortened)
    obj = result.objects[0]
    assert obj.valid and obj.desc == "black 猫 café"
    assert tiny_tokenizer.decode([ids[i] for i in obj.desc_token_positions]) == "black 猫 café"
    start, end = obj.token_span
    parts = set(obj.struct_token_positions) | set(obj.desc_token_positions) | set(obj.coord_token_indices)
    assert parts == set(range(start, end))
    assert len(obj.struct_token_positions) + len(obj.desc_token_positions) + 4 == end - start
    assert tiny_tokenizer.decode([ids[i] for i in obj.struct_token_positions]).startswith('{"object_1": {"desc": "')


def test_malformed_syntax_ends_the_usable_prefix(tiny_tokenizer, coord_vocab, enc, parse):
    """A syntax error cannot stay in a prefix that must remain valid JSON: later entries are not retained."""
    broken = '"object_2": {"desc": "b", "bbox_2d": ["' + C(1) + '", "' + C(2) + '", "' + C(3) + '", "' + C(4) + '"}'
    ids = enc("{" + entry(1) + ", " + broken + ", " + entry(3) + "}")
    result = parse(ids)
    assert [o.index for o in result.objects] == [1]
    assert dict(result.dropped_by_reason) == {"malformed": 1}
    assert not result.truncated and result.max_object_index == 1
    check_prefix_invariants(result, ids, tiny_tokenizer, coord_vocab)
    json.loads(result.prefix_text + "}")


@pytest.mark.parametrize(
    "tail",
    [
        ' "object_2": {}}',  # missing comma between entries
        ", }",  # trailing comma
        ', "object_2": {"desc": "b", "bbox_2d": [foo]}}',  # invalid bare literal
        ', "object_2": {"desc": "b",, "bbox_2d": []}}',  # double comma
        ', "object_2": {"desc": "b" "bbox_2d": []}}',  # missing comma inside
        ', "object_2": {"desc": "b\\q", "bbox_2d": []}}',  # bad escape
        ', "object_2": ["' + C(1) + '",]}',  # trailing comma in an array
        ', "object_2" {}}',  # missing colon
        ", 5: {}}",  # non-string key
    ],
)
def test_syntax_errors_keep_earlier_objects(enc, parse, tail):
    result = parse(enc("{" + entry(1) + tail))
    assert [o.index for o in result.objects] == [1]
    assert result.dropped_by_reason.get("malformed") == 1
    json.loads(result.prefix_text + "}")


def test_truncated_mid_object_keeps_the_complete_ones(tiny_tokenizer, coord_vocab, enc, parse):
    text = "{" + entry(1) + ", " + entry(2)
    ids = enc(text)
    for stop in range(1, len(ids)):
        result = parse(ids[:stop])
        check_prefix_invariants(result, ids[:stop], tiny_tokenizer, coord_vocab)
        complete = [o.index for o in result.objects]
        assert all(o.valid for o in result.objects)
        assert result.truncated
        assert complete in ([], [1])
    result = parse(enc(text + ', "object_3": {"desc": "do'))
    assert [o.index for o in result.objects] == [1, 2]
    assert dict(result.dropped_by_reason) == {"truncated": 1}
    assert result.prefix_text.endswith("]}")
    nothing = parse(enc('{"object_1": {"desc": "cat", "bbox_2d": ["' + C(1)))
    assert nothing.prefix_text == "{" and nothing.objects == () and nothing.truncated
    assert nothing.max_object_index is None


def test_trailing_non_dict_entry_is_not_retained(enc, parse):
    result = parse(enc("{" + entry(1) + ', "object_4": 123}'))
    assert [o.index for o in result.objects] == [1] and result.max_object_index == 1
    assert dict(result.dropped_by_reason) == {"non_object_value": 1}


@pytest.mark.parametrize("text, reason", [("junk {" + entry(1) + "}", "leading_text"), ('Sure! {"object_1": {', "leading_text"),
                                          ("no json here", "no_open_brace"), ("", "no_open_brace"), ("  \n", "no_open_brace")])
def test_text_before_the_first_brace_falls_back_to_the_empty_prefix(tiny_tokenizer, enc, parse, text, reason):
    result = parse(enc(text + "<|im_end|>"))
    assert result.prefix_fallback == reason
    assert result.prefix_ids == tuple(enc("{")) and result.prefix_text == "{"
    assert result.objects == () and result.max_object_index is None and result.n_kept == 0
    if text.startswith("junk"):
        assert dict(result.dropped_by_reason) == {"prefix_fallback": 1}


def test_leading_whitespace_is_kept_in_the_prefix(enc, parse):
    ids = enc("\n  {" + entry(1) + "}")
    result = parse(ids)
    assert result.prefix_fallback is None and result.prefix_text.startswith("\n  {")
    assert [o.valid for o in result.objects] == [True]


def test_empty_object_and_text_after_the_closing_brace(enc, parse):
    empty = parse(enc("{}"))
    assert empty.prefix_text == "{" and empty.objects == () and not empty.truncated
    after = parse(enc("{" + entry(1) + "} and more text"))
    assert after.prefix_text.endswith("]}") and not after.truncated and len(after.valid_objects) == 1


def _ids(piece_id, enc, *parts):
    """Token ids from parts: ``("p", text)`` is ONE token with exactly that text, a plain str is encoded."""
    out = []
    for part in parts:
        out.extend([piece_id(part[1])] if isinstance(part, tuple) else enc(part))
    return out


@pytest.mark.parametrize(
    "closing, kept_text",
    [
        (('"]}}',), '"]}'),  # top-level close fused into the object's close
        (('"]},',), '"]}'),  # comma fused, then the rollout ends
        (('"]', "}}"), "}"),
        (('"]', "},"), "}"),
        (('"]', "},", "<|im_end|>"), "}"),
    ],
)
def test_fused_final_token_is_replaced_by_a_shorter_encoding(tiny_tokenizer, coord_vocab, enc, piece_id, parse, closing, kept_text):
    head = '{"object_1": {"desc": "cat", "bbox_2d": ["' + '", "'.join(C(v) for v in (1, 2, 3, 4))
    parts = [head] + [("p", c) if c != "<|im_end|>" else c for c in closing]
    ids = _ids(piece_id, enc, *parts)
    result = parse(ids)
    assert len(result.valid_objects) == 1 and result.cut_fallbacks == 0
    fused_at = result.n_kept
    assert tiny_tokenizer.decode([ids[fused_at]]).startswith(kept_text)
    assert tiny_tokenizer.decode(list(result.prefix_ids[fused_at:])) == kept_text
    assert result.prefix_ids[:fused_at] == tuple(ids[:fused_at])
    assert result.prefix_text == tiny_tokenizer.decode(ids[:fused_at]) + kept_text
    obj = result.objects[0]
    assert obj.token_span[1] == len(result.prefix_ids)
    assert set(range(fused_at, len(result.prefix_ids))) <= set(obj.struct_token_positions)
    check_prefix_invariants(result, ids, tiny_tokenizer, coord_vocab)


def test_geometry_first_fused_desc_close(tiny_tokenizer, enc, piece_id, parse):
    ids = _ids(piece_id, enc, '{"object_1": {"bbox_2d": ' + box(1, 2, 3, 4) + ', "desc": "cat', ("p", '"}}'))
    result = parse(ids)
    assert result.objects[0].valid and result.prefix_text.endswith('"cat"}')
    assert tiny_tokenizer.decode(list(result.prefix_ids[result.n_kept :])) == '"}'


def test_cut_on_a_token_boundary_keeps_tokens_unchanged(enc, piece_id, parse):
    ids = _ids(piece_id, enc, '{"object_1": {"desc": "cat", "bbox_2d": ' + box(1, 2, 3, 4)[:-2], ("p", '"]'), ("p", "}"), ("p", "}"))
    result = parse(ids)
    assert result.prefix_ids == tuple(ids[:-1]) and result.n_kept == len(ids) - 1


def test_unexpressible_cut_falls_back_to_the_previous_boundary(tiny_tokenizer, coord_vocab, enc, piece_id, piece_table, parse):
    """If the tokenizer cannot re-express the shortened final token, step back one boundary and count it."""
    real = piece_table.encode
    stubborn = dataclasses.replace(piece_table, encode=lambda s: real(s) if s == "{" else [0], _replacements={})
    ids = _ids(piece_id, enc, "{" + entry(1)[:-3], ("p", '"]'), ("p", "}"), ("p", ","), " " + entry(2)[:-3], ("p", '"]}}'))
    result = parse(ids, piece_table=stubborn)
    assert result.cut_fallbacks == 1
    assert [o.index for o in result.objects] == [1]
    assert dict(result.dropped_by_reason) == {"cut_fallback": 1}
    assert result.prefix_text.endswith('"]}') and result.prefix_ids == tuple(ids[: result.n_kept])
    check_prefix_invariants(result, ids, tiny_tokenizer, coord_vocab)
    # every boundary fused: back to "{" itself (re-expressible), both objects lost
    fused = _ids(piece_id, enc, "{" + entry(1)[:-3], ("p", '"]},'), " " + entry(2)[:-3], ("p", '"]}}'))
    result = parse(fused, piece_table=stubborn)
    assert result.cut_fallbacks == 2 and result.objects == () and result.prefix_text == "{"
    assert dict(result.dropped_by_reason) == {"cut_fallback": 2}


def test_ids_outside_the_vocabulary_are_rejected(tiny_tokenizer, parse):
    with pytest.raises(ValueError, match="outside|must lie"):
        parse([len(tiny_tokenizer) + 5])


def test_piece_table_is_cached_per_tokenizer(tiny_tokenizer, piece_table):
    from coordexp.runtime.core.pieces import PieceTable

    assert PieceTable.for_tokenizer(tiny_tokenizer) is piece_table
    assert piece_table.text_of(tiny_tokenizer.encode("猫", add_special_tokens=False)) == "猫".encode()


def test_loads_coord_json_accepts_bare_tokens():
    assert loads_coord_json('{"a": [' + C(1) + ', "' + C(2) + '"]}') == {"a": [C(1), C(2)]}


def test_fast_parsed_object_construction_equals_the_dataclass_constructor():
    from coordexp.runtime.core.parsing import ParsedObject, _parsed_object

    values = dict(
        key="object_3", index=3, desc="cat", geometry="poly", coords=(1, 2, 3, 4, 5, 6), coord_token_indices=(4, 6, 8, 10, 12, 14),
        valid=True, drop_reason=None, token_span=(0, 16), struct_token_positions=(0, 1, 5), desc_token_positions=(2, 3),
    )
    fast, slow = _parsed_object(**values), ParsedObject(**values)
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow) and type(fast) is ParsedObject
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.valid = False
    with pytest.raises(TypeError, match="fields mismatch"):
        _parsed_object(**{k: v for k, v in values.items() if k != "desc"})


@pytest.mark.parametrize("desc", ["-", "--", ""])
def test_batch_finish_equals_the_general_finish_when_the_replaced_token_overlaps_the_desc(desc):
    # A real BPE can fuse a punctuation-only desc with its closing quote and braces ('-"}}'); the tiny tokenizer
    # cannot, so the token layout is written by hand: one token per byte, one per coord, then the fused token.
    import re

    import numpy as np

    from coordexp.runtime.core.json_scan import _FAST_ENTRY_RE, _Scanner
    from coordexp.runtime.core.parsing import _finish, _finish_fast, _general_entry

    coords = "".join(f'"{C(v)}", ' for v in (1, 2, 3, 4))[:-2]
    body = f'{{"bbox_2d": [{coords}], "desc": "{desc}'
    text = ("{" + '"object_1": ' + body).encode()
    merged = re.findall(rb"<\|coord_[0-9]+\|>|.", text, re.S)  # a coord token, else one token per byte
    fused = (desc[-1:] + '"}}').encode()
    if desc:
        merged[-1:] = []  # the desc's last byte moves into the fused token
    merged.append(fused)
    text = b"".join(merged)
    starts = np.concatenate([[0], np.cumsum([len(p) for p in merged])]).astype(np.int64)
    bins = np.array([int(re.fullmatch(rb"<\|coord_(\d+)\|>", p)[1]) if p.startswith(b"<|") else -1 for p in merged])
    coord_cum = np.concatenate([[0], np.cumsum(bins >= 0)]).astype(np.int64)
    scanner = _Scanner(text, starts, bins, coord_cum, np.flatnonzero(bins >= 0))
    match = _FAST_ENTRY_RE.match(text, 1)
    assert match is not None and match.group("sep") == b"}"
    n_kept = len(merged) - 1
    replacement, rep_lengths = (7, 8), [len(fused) - 2, 2]  # the cut keeps '-"}' (or '"}'): two new tokens
    (fast,) = _finish_fast([match], scanner, n_kept, replacement, rep_lengths)
    general = _finish(_general_entry(match, scanner), scanner, n_kept, replacement, rep_lengths)
    assert fast == general
    assert fast.token_span[1] == n_kept + 2
    assert (n_kept in fast.desc_token_positions) == bool(desc)  # the first new token holds the desc's last byte


def test_to_det_object_equals_the_dataclass_constructor(tiny_tokenizer, coord_vocab, enc, parse):
    result = parse(enc("{" + entry(1, desc="猫", geometry="poly", array="[" + ", ".join(f'"{C(v)}"' for v in range(6)) + "]") + "}"))
    (obj,) = result.objects
    fast, slow = obj.to_det_object(), DetObject("猫", "poly", (0, 1, 2, 3, 4, 5))
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow) and type(fast) is DetObject
    assert fast.__dict__ == slow.__dict__
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.desc = "dog"
