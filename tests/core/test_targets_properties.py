"""Hypothesis: random object sets, random renderings and random truncation points, parsed and rebuilt into Y_train."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.parsing import cut_after_objects, parse_rollout
from coordexp.runtime.core.serialize import loads_coord_json
from coordexp.runtime.core.targets import build_train_target, check_supervision_in_span
from coordexp.schema.pipeline import TokenCeConfig

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
DESC_CHARS = "abcxyz AB-_/'.{}[],:\"\\猫é"
coord = st.integers(0, 999)


@st.composite
def det_objects(draw) -> DetObject:
    desc = draw(st.text(DESC_CHARS, min_size=1, max_size=12).filter(lambda s: s.strip()))
    if draw(st.booleans()):
        x1, x2 = sorted(draw(st.tuples(coord, coord)))
        y1, y2 = sorted(draw(st.tuples(coord, coord)))
        return DetObject(desc, "bbox_2d", (x1, y1, x2, y2))
    n = draw(st.integers(3, 6))
    return DetObject(desc, "poly", tuple(draw(st.lists(coord, min_size=2 * n, max_size=2 * n))))


@dataclass(frozen=True)
class Entry:
    index: int
    text: str
    expected: DetObject | None  # None: invalid
    reason: str | None


INVALID_BODIES = {
    "bbox_arity": '{"desc": "q", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_3|>"]}',
    "bbox_invalid": '{"desc": "q", "bbox_2d": ["<|coord_9|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}',
    "missing_desc": '{"bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}',
    "non_coord_value": '{"desc": "q", "poly": [1, 2, 3, 4, 5, 6]}',
    "poly_arity": '{"poly": ["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>", "<|coord_5|>"], "desc": "q"}',
}


@st.composite
def rollout_entries(draw) -> Entry:
    index = draw(st.integers(0, 40))
    if draw(st.integers(0, 5)) == 0:
        reason = draw(st.sampled_from(sorted(INVALID_BODIES)))
        return Entry(index, f'"object_{index}": {INVALID_BODIES[reason]}', None, reason)
    obj = draw(det_objects())
    quoted = draw(st.booleans())
    tokens = [f"<|coord_{v}|>" for v in obj.coords]
    tokens = [f'"{t}"' for t in tokens] if quoted else tokens
    if obj.geometry == "poly" and draw(st.booleans()):
        array = "[" + ", ".join(f"[{x}, {y}]" for x, y in zip(tokens[::2], tokens[1::2])) + "]"
    else:
        array = "[" + ", ".join(tokens) + "]"
    fields = [f'"desc": {json.dumps(obj.desc, ensure_ascii=False)}', f'"{obj.geometry}": {array}']
    if draw(st.booleans()):
        fields.reverse()
    return Entry(index, f'"object_{index}": {{{", ".join(fields)}}}', obj, None)


@st.composite
def rollouts(draw):
    entries = draw(st.lists(rollout_entries(), min_size=0, max_size=6))
    lead = draw(st.sampled_from(["", "", "", " ", "\n", "junk "]))
    ending = draw(st.sampled_from(["}", "}<|im_end|>", "}<|im_end|> trailing {", "}}", ""]))
    return lead, entries, ending


@given(case=rollouts(), cut=st.floats(0, 1), gt=st.lists(det_objects(), max_size=5), data=st.data())
@SETTINGS
def test_parse_and_rebuild_random_rollouts(tiny_tokenizer, coord_vocab, piece_table, case, cut, gt, data):
    lead, entries, ending = case
    text = lead + "{" + ", ".join(e.text for e in entries) + ending
    full_ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    ids = full_ids[: round(cut * len(full_ids))]
    parse = parse_rollout(ids, tiny_tokenizer, coord_vocab)

    # --- the prefix: only its last token may differ from the rollout, and it is append-ready
    assert parse.prefix_ids[: parse.n_kept] == tuple(ids[: parse.n_kept])
    assert tiny_tokenizer.decode(list(parse.prefix_ids)) == parse.prefix_text
    assert parse.prefix_text.rstrip()[-1] in "{}"
    kept_text = piece_table.text_of(ids[: parse.n_kept])
    if parse.prefix_fallback is None:
        replaced = piece_table.text_of(parse.prefix_ids[parse.n_kept :])
        if replaced:
            assert piece_table.pieces[ids[parse.n_kept]].startswith(replaced)
            assert replaced != piece_table.pieces[ids[parse.n_kept]]
        assert parse.prefix_text.encode() == kept_text + replaced

    # --- exactly the complete entries are retained, in appearance order, with the expected content
    seen = piece_table.text_of(parse.response_ids)
    if not seen.strip():
        assert parse.prefix_fallback == "no_open_brace" and not parse.truncated
    elif lead.strip():
        assert parse.prefix_fallback == ("leading_text" if b"{" in seen else "no_open_brace")
        assert parse.objects == ()
    else:
        offset = len(lead) + 1
        complete = []
        for e in entries:
            end = offset + len(e.text.encode())
            if len(seen) >= end:
                complete.append(e)
            offset = end + 2
        body_end = len(lead) + 1 + len(", ".join(e.text for e in entries).encode())
        closed = ending.startswith("}") and len(seen) > body_end
        assert parse.truncated == (not closed)
        assert [o.index for o in parse.objects] == [e.index for e in complete]
        for obj, e in zip(parse.objects, complete):
            if e.expected is None:
                assert (obj.valid, obj.drop_reason) == (False, e.reason)
            else:
                assert obj.valid, (obj.drop_reason, e.text)
                assert obj.to_det_object() == e.expected
                assert [coord_vocab.bin_of(parse.prefix_ids[i]) for i in obj.coord_token_indices] == list(obj.coords)
                assert max(obj.coord_token_indices) < parse.n_kept
        assert parse.max_object_index == max((e.index for e in complete), default=None)

    # --- Y_train from a random one-to-one matching
    valid_positions = [i for i, o in enumerate(parse.objects) if o.valid]
    n_pairs = data.draw(st.integers(0, min(len(valid_positions), len(gt))))
    preds = data.draw(st.permutations(valid_positions))[:n_pairs]
    gts = data.draw(st.permutations(range(len(gt))))[:n_pairs]
    pairs = list(zip(preds, gts))
    targets = {p: np.linspace(0, 999, len(parse.objects[p[0]].coord_token_indices)) for p in pairs}
    weights = TokenCeConfig(rollout_fn_desc_weight=data.draw(st.sampled_from([0.0, 0.5])),
                            rollout_matched_prefix_struct_weight=data.draw(st.sampled_from([0.0, 0.3])))
    order = data.draw(st.sampled_from(["desc_first", "geometry_first"]))
    target = build_train_target(parse, gt, pairs, targets, tiny_tokenizer, coord_vocab, field_order=order,
                                token_ce=weights, eos_id=tiny_tokenizer.eos_token_id)
    check_supervision_in_span(target)
    # the rollout's own ids are kept; only a cut token the parser re-encoded joins the append (encoded with it)
    assert target.prefix_len in (parse.n_kept, len(parse.prefix_ids))
    assert target.ids[: target.prefix_len] == parse.prefix_ids[: target.prefix_len]
    assert piece_table.text_of(parse.prefix_ids[target.prefix_len :]) == target.joined_text.encode()
    # the cached segment-wise encoding of the append equals encoding the joined text as a whole
    assert target.ids[target.prefix_len : -1] == tuple(
        tiny_tokenizer.encode(target.joined_text + target.append_text, add_special_tokens=False))
    assert target.fn_gt_indices == tuple(sorted(set(range(len(gt))) - set(gts)))
    y_text = tiny_tokenizer.decode(list(target.ids[:-1]))
    loaded = loads_coord_json(y_text)
    assert isinstance(loaded, dict)
    if all('"<|coord_' in e.text or "<|coord_" not in e.text for e in entries):
        json.loads(y_text)

    # --- re-parsing Y_train: every retained rollout object, then every FN object, nothing truncated
    again = parse_rollout(list(target.ids), tiny_tokenizer, coord_vocab)
    assert again.stopped_at_eos and not again.truncated and again.prefix_fallback is None
    n_prefix = len(parse.objects)
    assert [(o.index, o.valid, o.drop_reason, o.coords) for o in again.objects[:n_prefix]] == [
        (o.index, o.valid, o.drop_reason, o.coords) for o in parse.objects
    ]
    appended = again.objects[n_prefix:]
    assert [o.to_det_object() for o in appended] == [gt[g] for g in target.fn_gt_indices]
    assert [o.index for o in appended] == list(range(target.start_index, target.start_index + len(appended)))
    assert all(o.index > (parse.max_object_index if parse.max_object_index is not None else 0) for o in appended)

    # --- supervision: coord slots hold coord ids, CE never hits a coord slot, the prefix text stays unsupervised
    sup = target.supervision
    tail = sup.coord_positions[sup.coord_positions >= target.prefix_len]
    assert tail.tolist() == [i for o in appended for i in o.coord_token_indices]
    tail_targets = sup.coord_targets[sup.coord_positions >= target.prefix_len]
    assert coord_vocab.bins_of([target.ids[p] for p in tail.tolist()]).tolist() == tail_targets.astype(int).tolist()
    assert all(coord_vocab.is_coord(target.ids[p]) for p in sup.coord_positions.tolist())
    assert not any(coord_vocab.is_coord(target.ids[p]) for p in sup.ce_positions.tolist())
    prefix_ce = sup.ce_positions[sup.ce_positions < target.prefix_len]
    allowed = {p for pred, _ in pairs for p in parse.objects[pred].struct_token_positions}
    assert set(prefix_ce.tolist()) <= allowed
    assert sup.ce_positions[-1] == len(target.ids) - 1
    n_boxes = sum(parse.objects[p].geometry == "bbox_2d" for p, _ in pairs)
    n_boxes += sum(gt[g].geometry == "bbox_2d" for g in target.fn_gt_indices)
    assert sup.bbox_slots.shape == (n_boxes, 4)


@given(case=rollouts(), cut=st.floats(0, 1))
@SETTINGS
def test_fast_path_agrees_with_the_general_scanner(tiny_tokenizer, coord_vocab, monkeypatch, case, cut):
    import coordexp.runtime.core.parsing as parsing

    lead, entries, ending = case
    ids = tiny_tokenizer.encode(lead + "{" + ", ".join(e.text for e in entries) + ending, add_special_tokens=False)
    ids = ids[: round(cut * len(ids))]
    fast = parse_rollout(ids, tiny_tokenizer, coord_vocab)
    with monkeypatch.context() as patch:
        patch.setattr(parsing, "_USE_FAST_PATH", False)
        general = parse_rollout(ids, tiny_tokenizer, coord_vocab)
    assert fast == general


@st.composite
def fast_path_edge_entries(draw) -> str:
    """Entry texts the fast regex matches but whose judgement needs care: coord text in the desc, coord text that
    is not one coord token, empty or escaped descs, pair nesting under bbox_2d, odd/short arrays, odd whitespace."""
    ws = st.sampled_from(["", " ", "\n", "\t ", "  "])
    quoted, bare = coord.map(lambda v: f'"<|coord_{v}|>"'), coord.map(lambda v: f"<|coord_{v}|>")
    not_a_token = st.sampled_from(['"<|coord_1000|>"', '"<|coord_0007|>"', "<|coord_05|>"])
    item = st.one_of(*[quoted] * 8, *[bare] * 4, not_a_token)
    n_items = draw(st.sampled_from([4, 4, 4, 6, 8, 1, 3, 5, 7]))
    items = draw(st.lists(item, min_size=n_items, max_size=n_items))
    if len(items) % 2 == 0 and draw(st.booleans()):
        array = "[" + ", ".join(f"[{a},{draw(ws)}{b}]" for a, b in zip(items[::2], items[1::2])) + "]"
    else:
        array = "[" + f",{draw(ws)}".join(items) + "]"
    desc = draw(st.sampled_from(["cat", "cat", "cat", "", " ", "a <|coord_5|> b", "<|coord_12|>", 'q\\"x', "\\u732b", "猫 é", "}, {"]))
    geometry = draw(st.sampled_from(["bbox_2d", "poly"]))
    fields = [f'"desc":{draw(ws)}"{desc}"', f'"{geometry}"{draw(ws)}:{draw(ws)}{array}']
    if draw(st.booleans()):
        fields.reverse()
    return f'"object_{draw(st.integers(0, 99))}"{draw(ws)}:{draw(ws)}{{{draw(ws)}{("," + draw(ws)).join(fields)}{draw(ws)}}}'


@given(
    entries=st.lists(fast_path_edge_entries(), min_size=1, max_size=5),
    ending=st.sampled_from(["}", "}}", "}<|im_end|>", " }", ", ", ""]),
    cut=st.floats(0, 1),
)
@SETTINGS
def test_fast_path_agrees_with_the_general_scanner_on_edge_entries(
    tiny_tokenizer, coord_vocab, monkeypatch, entries, ending, cut
):
    import coordexp.runtime.core.parsing as parsing

    ids = tiny_tokenizer.encode("{" + ", ".join(entries) + ending, add_special_tokens=False)
    ids = ids[: max(1, round(cut * len(ids)))] if cut < 0.5 else ids  # half the cases: the whole rollout
    fast = parse_rollout(ids, tiny_tokenizer, coord_vocab)
    with monkeypatch.context() as patch:
        patch.setattr(parsing, "_USE_FAST_PATH", False)
        general = parse_rollout(ids, tiny_tokenizer, coord_vocab)
    assert fast == general


KEYISH_DESCS = st.sampled_from(['object_12": {', '"object_3": {"x', "a 7 b", "42", " 9x", "_1", 'q\\"object_5": {'])


@given(
    objects=st.lists(det_objects() | st.builds(DetObject, KEYISH_DESCS, st.just("bbox_2d"), st.just((1, 2, 3, 4))), max_size=6),
    start_index=st.integers(1, 12000),
    prefix=st.sampled_from(["{", '{"object_1": {}', "{ ", '{"object_1": {},']),
    field_order=st.sampled_from(["desc_first", "geometry_first"]),
)
@SETTINGS
def test_cached_segment_encoding_equals_encoding_the_whole_append_text(
    tiny_tokenizer, coord_vocab, objects, start_index, prefix, field_order
):
    # The append is assembled from cached encodings of the text between coord tokens, each split once more
    # around the object key's number; it must equal what the tokenizer gives for the whole text, cold or warm.
    from coordexp.runtime.core.pieces import PieceTable
    from coordexp.runtime.core.serialize import render_append
    from coordexp.runtime.core.targets import encode_append

    if prefix.rstrip().endswith(",") and not objects:
        return  # nothing to append after a trailing comma: render_append refuses it (tested elsewhere)
    rendered = render_append(objects, start_index, prefix, field_order)
    expected = tuple(tiny_tokenizer.encode(rendered.text, add_special_tokens=False))
    cold = PieceTable.from_tokenizer(tiny_tokenizer)
    assert encode_append(rendered, tiny_tokenizer, coord_vocab, cold) == expected
    assert encode_append(rendered, tiny_tokenizer, coord_vocab, cold) == expected  # from the warm cache
    assert cold.splits_at_object_numbers()


@given(ids=st.lists(st.integers(0, 3055), max_size=40))
@settings(max_examples=200, deadline=None)
def test_pieces_concatenate_to_the_decoded_text(tiny_tokenizer, piece_table, ids):
    decoded = tiny_tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert piece_table.text_of(ids).decode("utf-8", "replace") == decoded


@given(ids=st.lists(st.integers(0, 3055), max_size=60))
@settings(max_examples=200, deadline=None)
def test_arbitrary_token_soup_never_crashes_and_stays_append_ready(tiny_tokenizer, coord_vocab, ids):
    parse = parse_rollout(ids, tiny_tokenizer, coord_vocab)
    assert parse.prefix_ids[: parse.n_kept] == tuple(parse.response_ids[: parse.n_kept])
    assert parse.prefix_text.rstrip()[-1] in "{}"
    for obj in parse.valid_objects:
        assert [coord_vocab.bin_of(parse.prefix_ids[i]) for i in obj.coord_token_indices] == list(obj.coords)


# --- cut_after_objects: a shorter suffix-only trim (rollout_matching.trailing_unmatched: drop)


@given(case=rollouts(), data=st.data())
@SETTINGS
def test_a_cut_keeps_the_first_entries_and_the_rollouts_ids(tiny_tokenizer, coord_vocab, piece_table, case, data):
    lead, entries, ending = case
    ids = tiny_tokenizer.encode(lead + "{" + ", ".join(e.text for e in entries) + ending, add_special_tokens=False)
    parse = parse_rollout(ids, tiny_tokenizer, coord_vocab)
    n = data.draw(st.integers(0, len(parse.objects)))
    cut = cut_after_objects(parse, n, tiny_tokenizer, coord_vocab, piece_table=piece_table)

    assert len(cut.objects) == n
    for mine, theirs in zip(cut.objects, parse.objects):
        assert (mine.key, mine.valid, mine.coords, mine.coord_token_indices) == (
            theirs.key, theirs.valid, theirs.coords, theirs.coord_token_indices)
    assert cut.prefix_ids[: cut.n_kept] == tuple(ids[: cut.n_kept])  # a prefix of the rollout, last token at most
    assert cut.n_kept <= parse.n_kept and cut.prefix_text.rstrip()[-1] in "{},"
    assert (cut.truncated, cut.stopped_at_eos, dict(cut.dropped_by_reason)) == (
        parse.truncated, parse.stopped_at_eos, dict(parse.dropped_by_reason))  # the rollout's telemetry
    if n == len(parse.objects):
        assert cut is parse
    again = parse_rollout(cut.prefix_ids, tiny_tokenizer, coord_vocab)  # the prefix holds the kept entries, no more
    assert [o.key for o in again.objects] == [o.key for o in cut.objects]


def test_a_count_outside_the_entries_is_refused(tiny_tokenizer, coord_vocab):
    parse = parse_rollout(tiny_tokenizer.encode('{"object_1": {"desc": "a", "bbox_2d": '
                                                '["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}}',
                                                add_special_tokens=False), tiny_tokenizer, coord_vocab)
    with pytest.raises(ValueError, match="n_objects 2"):
        cut_after_objects(parse, 2, tiny_tokenizer, coord_vocab)
