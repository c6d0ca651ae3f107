"""GT serialization, SerializeAppend and the Y_train builder with hand-checked supervision."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.parsing import parse_rollout
from coordexp.runtime.core.targets import (
    build_train_target,
    check_supervision_in_span,
    serialize_append,
    serialize_objects,
)
from coordexp.schema.pipeline import TokenCeConfig

CAT = DetObject("cat", "bbox_2d", (102, 98, 205, 199))
SIGN = DetObject("sign", "poly", (10, 20, 200, 20, 200, 220))
BASELINE = TokenCeConfig(rollout_fn_desc_weight=0.0, rollout_matched_prefix_struct_weight=0.0)


def test_serialize_objects_matches_decision_3_exactly():
    assert serialize_objects([CAT, SIGN]) == (
        '{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_102|>", "<|coord_98|>", "<|coord_205|>", "<|coord_199|>"]}, '
        '"object_2": {"desc": "sign", "poly": ["<|coord_10|>", "<|coord_20|>", "<|coord_200|>", "<|coord_20|>", '
        '"<|coord_200|>", "<|coord_220|>"]}}'
    )
    assert serialize_objects([CAT], "geometry_first") == (
        '{"object_1": {"bbox_2d": ["<|coord_102|>", "<|coord_98|>", "<|coord_205|>", "<|coord_199|>"], "desc": "cat"}}'
    )
    assert serialize_objects([]) == "{}"
    odd = DetObject('say "hi"\n猫', "bbox_2d", (1, 1, 1, 1))
    assert json.loads(serialize_objects([odd]))["object_1"]["desc"] == 'say "hi"\n猫'
    assert "猫" in serialize_objects([odd])  # unicode is kept, not \u-escaped


@pytest.mark.parametrize(
    "prefix, expected",
    [
        ('{"object_1": {"desc": "a", "bbox_2d": []}', ', "object_2": {"desc": "cat", "bbox_2d": ["<|coord_102|>", "<|coord_98|>", "<|coord_205|>", "<|coord_199|>"]}}'),
        ("{", '"object_2": {"desc": "cat", "bbox_2d": ["<|coord_102|>", "<|coord_98|>", "<|coord_205|>", "<|coord_199|>"]}}'),
        ('{"object_1": {}, \n ', '"object_2": {"desc": "cat", "bbox_2d": ["<|coord_102|>", "<|coord_98|>", "<|coord_205|>", "<|coord_199|>"]}}'),
        ("{ \n", '"object_2": {"desc": "cat", "bbox_2d": ["<|coord_102|>", "<|coord_98|>", "<|coord_205|>", "<|coord_199|>"]}}'),
    ],
)
def test_serialize_append_comma_rule(prefix, expected):
    assert serialize_append([CAT], 2, prefix) == expected
    assert json.loads(prefix + expected)


def test_serialize_append_empty_fn_set_and_errors():
    assert serialize_append([], 5, "{") == "}"
    assert serialize_append([], 5, '{"object_1": {}') == "}"
    with pytest.raises(ValueError, match="ends with ','"):
        serialize_append([], 5, '{"object_1": {},')
    with pytest.raises(ValueError, match=r"not append-ready: its last non-whitespace character is '\]'"):
        serialize_append([CAT], 1, '{"a": [1]')
    with pytest.raises(ValueError, match="empty"):
        serialize_append([CAT], 1, "  ")
    with pytest.raises(ValueError, match="object_field_order"):
        serialize_append([CAT], 1, "{", "desc_last")
    with pytest.raises(ValueError, match="start_index"):
        serialize_append([CAT], 0, "{")


def test_serialize_append_geometry_first_numbers_from_start_index():
    text = serialize_append([CAT, SIGN], 10, "{", "geometry_first")
    assert text.startswith('"object_10": {"bbox_2d": [') and '"object_11": {"poly": [' in text
    assert text.endswith('"], "desc": "sign"}}')


@pytest.mark.parametrize("field_order", ["desc_first", "geometry_first"])
@pytest.mark.parametrize("lead_prefix", ["{", '{"object_1": {}'])
def test_rendered_append_spans_point_at_the_desc_values_and_coord_tokens(field_order, lead_prefix):
    from coordexp.runtime.core.serialize import render_append

    objects = [CAT, DetObject('猫 "x"\\é', "poly", (7, 8, 90, 8, 90, 100)), DetObject("a\tb", "bbox_2d", (0, 0, 999, 999))]
    rendered = render_append(objects, 5, lead_prefix, field_order)
    raw = rendered.text.encode("utf-8")
    assert [json.loads(b'"' + raw[lo:hi] + b'"') for lo, hi in rendered.desc_spans] == [o.desc for o in objects]
    assert [raw[lo:hi].decode() for _, lo, hi in rendered.coord_spans] == [f"<|coord_{v}|>" for o in objects for v in o.coords]
    assert [b for b, _, _ in rendered.coord_spans] == [v for o in objects for v in o.coords]
    rebuilt = rendered.segments[0] + "".join(
        f"<|coord_{b}|>" + segment for (b, _, _), segment in zip(rendered.coord_spans, rendered.segments[1:])
    )
    assert rebuilt == rendered.text and rendered.geometries == ("bbox_2d", "poly", "bbox_2d")
    assert rendered.text == serialize_append(objects, 5, lead_prefix, field_order)


@pytest.mark.parametrize(
    "bad, message",
    [
        (DetObject("", "bbox_2d", (1, 2, 3, 4)), "non-empty"),
        (DetObject("a <|im_end|>", "bbox_2d", (1, 2, 3, 4)), "markup"),
        (DetObject("a", "bbox_2d", (1, 2, 3)), "4 values"),
        (DetObject("a", "bbox_2d", (5, 2, 3, 4)), "x2 < x1"),
        (DetObject("a", "bbox_2d", (1, 2, 3, 1000)), "0..999"),
        (DetObject("a", "bbox_2d", (1, 2, 3.5, 4)), "0..999"),
        (DetObject("a", "poly", (1, 2, 3, 4)), "even number"),
        (DetObject("a", "line", (1, 2, 3, 4)), "geometry"),
    ],
)
def test_invalid_ground_truth_fails_with_its_index(bad, message):
    with pytest.raises(ValueError, match=message):
        serialize_objects([CAT, bad])


@pytest.fixture()
def build(tiny_tokenizer, coord_vocab):
    def run(text, gt, pairs=(), targets=None, *, field_order="desc_first", token_ce=BASELINE):
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        parse = parse_rollout(ids, tiny_tokenizer, coord_vocab)
        target = build_train_target(
            parse, gt, list(pairs), targets if targets is not None else [], tiny_tokenizer, coord_vocab,
            field_order=field_order, token_ce=token_ce, eos_id=tiny_tokenizer.eos_token_id,
        )
        return parse, target

    return run


def _decoded(tokenizer, target, positions):
    return [tokenizer.decode([target.ids[p]]) for p in positions]


ROLLOUT = (
    '{"object_2": {"desc": "cat", "bbox_2d": ["<|coord_100|>", "<|coord_98|>", "<|coord_200|>", "<|coord_199|>"]}, '
    '"object_9": {"desc": "dog", "bbox_2d": ["<|coord_1|>"]}}<|im_end|>'
)


def test_spec_scenario_fn_keys_start_above_an_invalid_max_index(tiny_tokenizer, build):
    parse, target = build(ROLLOUT, [CAT, SIGN], [(0, 0)], {(0, 0): [102, 98, 205, 199]})
    assert parse.max_object_index == 9 and target.start_index == 10
    assert target.fn_gt_indices == (1,) and target.n_fn_appended == 1
    assert target.append_text.startswith(', "object_10": {"desc": "sign", "poly": [')
    y_train = tiny_tokenizer.decode(list(target.ids[:-1]))
    assert json.loads(y_train)["object_10"]["desc"] == "sign"
    # the rollout's fused '"]}}' was cut to '"]}' and is encoded together with the append: only it changes
    assert target.joined_text == '"]}' and target.prefix_len == parse.n_kept < len(parse.prefix_ids)
    assert target.ids[: target.prefix_len] == parse.response_ids[: parse.n_kept]
    assert target.ids[-1] == tiny_tokenizer.eos_token_id
    assert len(target.ids) == target.prefix_len + target.append_len + 1


def test_supervision_of_the_baseline(tiny_tokenizer, coord_vocab, build):
    parse, target = build(ROLLOUT, [CAT, SIGN], [(0, 0)], {(0, 0): [102, 98, 205, 199]})
    sup = target.supervision
    # coord slots: the matched prefix box with its targets, then every tail coord with its GT bin
    matched = parse.objects[0]
    tail_coord = [p for p in range(target.prefix_len, len(target.ids)) if coord_vocab.is_coord(target.ids[p])]
    assert sup.coord_positions.tolist() == list(matched.coord_token_indices) + tail_coord
    assert sup.coord_targets.tolist() == [102, 98, 205, 199, 10, 20, 200, 20, 200, 220]
    assert [coord_vocab.bin_of(target.ids[p]) for p in tail_coord] == [10, 20, 200, 20, 200, 220]
    assert sup.bbox_slots.tolist() == [[0, 1, 2, 3]]  # the poly FN has no box slots
    # CE: every tail token except coord and desc-value tokens, plus EOS, all weight 1; nothing in the prefix. The
    # first tail token '"]},' also closes the invalid object_9, so it is not taught either.
    assert sup.ce_positions.min() >= target.prefix_len
    assert np.all(sup.ce_weights == 1.0)
    ce_text = "".join(_decoded(tiny_tokenizer, target, sup.ce_positions))
    assert ce_text == ' "object_10": {"desc": "", "poly": ["", "", "", "", "", ""]}}<|im_end|>'
    assert tiny_tokenizer.decode([target.ids[target.prefix_len]]) == '"]},'
    assert sup.ce_positions[-1] == len(target.ids) - 1
    check_supervision_in_span(target)


def test_module_weights_add_desc_and_matched_prefix_structure(tiny_tokenizer, build):
    weights = TokenCeConfig(rollout_fn_desc_weight=0.25, rollout_matched_prefix_struct_weight=0.5)
    parse, target = build(ROLLOUT, [CAT, SIGN], [(0, 0)], {(0, 0): [102, 98, 205, 199]}, token_ce=weights)
    sup = target.supervision
    by_weight = {w: [int(p) for p, x in zip(sup.ce_positions, sup.ce_weights) if x == w] for w in (0.25, 0.5, 1.0)}
    assert _decoded(tiny_tokenizer, target, by_weight[0.25]) == ["sign"]
    assert by_weight[0.5] == sorted(parse.objects[0].struct_token_positions)
    prefix_struct = "".join(_decoded(tiny_tokenizer, target, by_weight[0.5]))
    assert prefix_struct == '{"object_2": {"desc": "", "bbox_2d": ["", "", "", ""]},'  # the comma is fused into "]},'
    assert all(p >= target.prefix_len for p in by_weight[1.0])
    # the unmatched (invalid) object_9 is never supervised (its kept tokens, and the tail token closing it)
    span = range(parse.objects[1].token_span[0], target.prefix_len + 1)
    assert not set(span) & set(sup.ce_positions.tolist()) and not set(span) & set(sup.coord_positions.tolist())


def test_all_gt_appended_when_nothing_matches(tiny_tokenizer, build):
    parse, target = build("Sure, here: " + ROLLOUT, [CAT, SIGN])
    assert parse.prefix_fallback == "leading_text" and target.prefix_fallback == "leading_text"
    assert target.fn_gt_indices == (0, 1) and target.start_index == 1
    y_train = tiny_tokenizer.decode(list(target.ids[:-1]))
    assert y_train == serialize_objects([CAT, SIGN])
    assert target.supervision.bbox_slots.tolist() == [[0, 1, 2, 3]]


def test_no_fn_closes_the_object(tiny_tokenizer, build):
    parse, target = build(ROLLOUT, [CAT], [(0, 0)], [[102, 98, 205, 199]])
    assert target.append_text == "}" and target.fn_gt_indices == ()
    assert json.loads(tiny_tokenizer.decode(list(target.ids[:-1])))["object_2"]["desc"] == "cat"
    _, empty = build("{}", [])
    assert tiny_tokenizer.decode(list(empty.ids)) == "{}<|im_end|>"
    assert empty.supervision.coord_positions.size == 0 and empty.supervision.bbox_slots.shape == (0, 4)


def test_geometry_first_changes_only_field_order(tiny_tokenizer, build):
    _, desc_first = build(ROLLOUT, [CAT, SIGN], [(0, 0)], [[1, 2, 3, 4]])
    _, geometry_first = build(ROLLOUT, [CAT, SIGN], [(0, 0)], [[1, 2, 3, 4]], field_order="geometry_first")
    assert geometry_first.append_text == ', "object_10": {"poly": ["<|coord_10|>", "<|coord_20|>", "<|coord_200|>", ' \
        '"<|coord_20|>", "<|coord_200|>", "<|coord_220|>"], "desc": "sign"}}'
    assert desc_first.supervision.coord_targets.tolist() == geometry_first.supervision.coord_targets.tolist()
    assert json.loads(tiny_tokenizer.decode(list(geometry_first.ids[:-1])))["object_10"]["desc"] == "sign"


def test_bare_coord_prefix_stays_as_generated(tiny_tokenizer, build):
    from coordexp.runtime.core.serialize import loads_coord_json

    rollout = '{"object_1": {"desc": "cat", "bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>]}'
    parse, target = build(rollout, [CAT, SIGN], [(0, 1)], [[1, 2, 3, 4]])
    assert target.fn_gt_indices == (0,)
    assert loads_coord_json(tiny_tokenizer.decode(list(target.ids[:-1])))["object_1"]["bbox_2d"][0] == "<|coord_1|>"


def test_bad_pairs_and_targets_fail_clearly(tiny_tokenizer, coord_vocab):
    parse = parse_rollout(tiny_tokenizer.encode(ROLLOUT, add_special_tokens=False), tiny_tokenizer, coord_vocab)

    def call(pairs, targets, **kw):
        args = dict(field_order="desc_first", token_ce=BASELINE, eos_id=tiny_tokenizer.eos_token_id)
        args.update(kw)
        return build_train_target(parse, [CAT, SIGN], pairs, targets, tiny_tokenizer, coord_vocab, **args)

    with pytest.raises(ValueError, match="invalid"):
        call([(1, 0)], [[1]])
    with pytest.raises(ValueError, match="not a position"):
        call([(5, 0)], [[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="gt index 7"):
        call([(0, 7)], [[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="one-to-one"):
        call([(0, 0), (0, 1)], [[1, 2, 3, 4]] * 2)
    with pytest.raises(ValueError, match="3 coord targets for 4 coord slots"):
        call([(0, 0)], [[1, 2, 3]])
    with pytest.raises(ValueError, match="finite bins"):
        call([(0, 0)], [[1, 2, 3, np.nan]])
    with pytest.raises(ValueError, match="no targets"):
        call([(0, 0)], {(0, 1): [1, 2, 3, 4]})
    with pytest.raises(ValueError, match="eos_id"):
        call([], [], eos_id=coord_vocab.id_of(3))


def test_check_supervision_in_span_catches_misaligned_positions(tiny_tokenizer, build):
    import dataclasses

    _, target = build(ROLLOUT, [CAT, SIGN], [(0, 0)], [[1, 2, 3, 4]])
    bad = dataclasses.replace(
        target,
        supervision=dataclasses.replace(target.supervision, coord_positions=target.supervision.coord_positions + 500),
    )
    with pytest.raises(ValueError, match="outside the assistant ids"):
        check_supervision_in_span(bad)
    clash = dataclasses.replace(
        target,
        supervision=dataclasses.replace(target.supervision, ce_positions=target.supervision.coord_positions.copy(),
                                        ce_weights=np.ones(target.supervision.coord_positions.size, np.float32)),
    )
    with pytest.raises(ValueError, match="both as text"):
        check_supervision_in_span(clash)


@pytest.mark.parametrize("prefix, why", [
    ('{"object_1": {"desc": "a", "bbox_2d": []}}', "closed"),
    ('{"object_1": {"desc": "a", "bbox_2d": []}} ', "closed"),
    ('{"object_1": {"desc": "a", "inner": {}', "nested"),
    ('{"object_1": {"desc": "a", "bbox_2d": [{},', "nested"),
    ('{"object_1": {"desc": "a}', "unterminated"),
    ('x {"object_1": {}', "start with"),
])
def test_serialize_append_refuses_a_closed_or_nested_prefix(prefix, why):
    # regression: a prefix whose top-level object was already closed got a fragment that made Y_train invalid JSON
    for objects in ([CAT], []):
        with pytest.raises(ValueError, match=why):
            serialize_append(objects, 2, prefix)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[]",: ab\\', max_size=30))
def test_serialize_append_either_refuses_or_yields_json(prefix):
    """Decision 3 as a property: whatever the prefix, the append is refused or ``prefix + append`` parses."""
    try:
        tail = serialize_append([CAT], 2, prefix)
    except ValueError:
        return
    try:
        json.loads(prefix + tail)
    except json.JSONDecodeError:
        # only prefixes that were not JSON-shaped to begin with may still fail (e.g. '{a}' keys without quotes)
        assert not _is_json_object_prefix(prefix)


def _is_json_object_prefix(prefix: str) -> bool:
    """Whether some completion of ``prefix`` as ``{... "k": 1}`` parses: the prefix is well-formed so far."""
    for completion in ("}", '"k": 1}', ' "k": 1}', "1}"):
        try:
            json.loads(prefix + completion)
            return True
        except json.JSONDecodeError:
            pass
    return False
