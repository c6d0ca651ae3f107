"""``Y_train = rollout prefix + SerializeAppend(FN) + EOS`` and its supervision (docs/design.md, target construction).

Positions are label positions into ``TrainTarget.ids`` (the assistant ids): position ``p`` supervises the
prediction of ``ids[p]``. The trainer shifts by the prompt length and re-checks the assistant span.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from coordexp.runtime.core.objects import DetObject, TokenSupervision
from coordexp.runtime.core.parsing import RolloutParse
from coordexp.runtime.core.pieces import PieceTable
from coordexp.runtime.core.serialize import (  # re-exported: the stable import path is coordexp.runtime.core.targets
    FieldOrder,
    RenderedAppend,
    append_lead,
    render_append,
    render_entries,
    serialize_append,
    serialize_objects,
    validate_gt_object,
)
from coordexp.runtime.core.tokens import CoordVocab
from coordexp.schema.pipeline import TokenCeConfig

__all__ = [
    "TrainTarget",
    "TailEntry",
    "encode_append",
    "build_train_target",
    "render_tail",
    "check_supervision_in_span",
    "serialize_append",
    "serialize_objects",
    "validate_gt_object",
]


@dataclass(frozen=True)
class TailEntry:
    """One object of the canonically serialized tail of ``Y_train`` (after the kept prefix), and how it is taught:
    ``fn`` a ground-truth object fully supervised (the spec's append), ``matched`` one of the rollout's own objects
    re-serialized after a splice point, its coordinates pulled toward ``coord_targets`` and its structure at
    ``rollout_matched_prefix_struct_weight`` (as in the prefix), ``neutral`` a rollout object written again as
    context with no loss (docs/design.md, decision 18)."""

    obj: DetObject
    role: Literal["fn", "matched", "neutral"]
    gt_index: int | None = None  # fn: the ground-truth object; matched: the object it matched
    coord_targets: tuple[float, ...] = ()  # matched: one target bin per coord token


@dataclass(frozen=True)
class TrainTarget:
    """One sample's canonical teacher-forced sequence and what each of its tokens is trained on.

    ``ids = prefix ids (unchanged) + append ids + (eos,)``: ``len(ids) == prefix_len + append_len + 1``. The append
    ids encode ``joined_text + append_text``: the text of a cut token the parser re-encoded (or of the ``{``
    fallback), then SerializeAppend(FN), as one string (docs/design.md, target construction).
    """

    ids: tuple[int, ...]
    prefix_len: int
    append_len: int
    supervision: TokenSupervision
    matched_pairs: tuple[tuple[int, int], ...]  # (position in parse.objects, gt index), by prediction order
    fn_gt_indices: tuple[int, ...]
    start_index: int
    append_text: str
    n_ambiguous: int
    prefix_fallback: str | None
    cut_fallbacks: int
    truncated: bool
    joined_text: str = ""
    tail: tuple[TailEntry, ...] = ()  # the serialized tail when it is not the plain FN append

    @property
    def n_fn_appended(self) -> int:
        return len(self.fn_gt_indices)

    @property
    def eos_position(self) -> int:
        return len(self.ids) - 1


def _check_pairs(parse: RolloutParse, n_gt: int, matched_pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    pairs = [(int(p), int(g)) for p, g in matched_pairs]
    preds = [p for p, _ in pairs]
    gts = [g for _, g in pairs]
    if len(set(preds)) != len(preds) or len(set(gts)) != len(gts):
        raise ValueError(f"matched_pairs must be one-to-one; got {pairs}")
    for p, g in pairs:
        if not 0 <= p < len(parse.objects):
            raise ValueError(f"matched pair {(p, g)}: prediction {p} is not a position in parse.objects (0..{len(parse.objects) - 1})")
        if not parse.objects[p].valid:
            obj = parse.objects[p]
            raise ValueError(f"matched pair {(p, g)}: {obj.key} is invalid ({obj.drop_reason}); only valid objects can be matched")
        if not 0 <= g < n_gt:
            raise ValueError(f"matched pair {(p, g)}: gt index {g} is outside 0..{n_gt - 1}")
    return sorted(pairs)


def _pair_targets(
    parse: RolloutParse,
    pairs: list[tuple[int, int]],
    pair_coord_targets: Mapping[tuple[int, int], Any] | Sequence[Any],
    original_order: list[tuple[int, int]],
) -> np.ndarray:
    """The targets of every pair, concatenated in ``pairs`` order (float64), checked against the coord slots."""
    if isinstance(pair_coord_targets, Mapping):
        lookup = {(int(p), int(g)): v for (p, g), v in pair_coord_targets.items()}
    else:
        if len(pair_coord_targets) != len(original_order):
            raise ValueError(
                f"pair_coord_targets has {len(pair_coord_targets)} entries for {len(original_order)} matched pairs; "
                "give one target array per pair, in the order of matched_pairs"
            )
        lookup = dict(zip(original_order, pair_coord_targets))
    objects = parse.objects
    n_slots = [len(objects[p].coord_token_indices) for p, _ in pairs]
    if pairs and all(pair in lookup for pair in pairs):  # one concatenation when every target is a flat array
        values = [lookup[pair] for pair in pairs]
        try:
            every = np.concatenate(values)
        except (ValueError, TypeError):
            every = None
        if every is not None and every.ndim == 1 and every.dtype.kind in "fiu" and list(map(len, values)) == n_slots:
            every = every.astype(np.float64, copy=False)
            if np.isfinite(every).all() and every.min(initial=0) >= 0 and every.max(initial=0) <= 999:
                return every
    out = []
    for pair in pairs:
        if pair not in lookup:
            raise ValueError(f"pair_coord_targets has no targets for matched pair {pair}")
        values = np.asarray(lookup[pair], dtype=np.float64).reshape(-1)
        n_slots = len(objects[pair[0]].coord_token_indices)
        if values.size != n_slots:
            raise ValueError(
                f"matched pair {pair}: {values.size} coord targets for {n_slots} coord slots of "
                f"{objects[pair[0]].key}; give one target bin per predicted coord token"
            )
        out.append(values)
    every = np.concatenate(out) if out else np.zeros(0)
    if np.isfinite(every).all() and every.min(initial=0) >= 0 and every.max(initial=0) <= 999:
        return every
    for pair, values in zip(pairs, out):  # only to name the offending pair
        if not np.all(np.isfinite(values)) or values.min(initial=0) < 0 or values.max(initial=0) > 999:
            raise ValueError(f"matched pair {pair}: coord targets must be finite bins in [0, 999], got {values.tolist()}")
    return every


def _append_token_layout(
    append_ids: tuple[int, ...], rendered: RenderedAppend, table: PieceTable, vocab: CoordVocab
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(coord token offsets, desc-value token offsets, byte starts) of the append ids, checked against the render."""
    if table.text_of(append_ids) != rendered.text.encode("utf-8"):
        raise ValueError(
            "the tokenizer does not round-trip the append text exactly (decode(encode(text)) != text); "
            f"text starts {rendered.text[:60]!r}"
        )
    ids_arr = np.fromiter(append_ids, dtype=np.int64, count=len(append_ids))
    starts = np.zeros(len(append_ids) + 1, dtype=np.int64)
    np.cumsum(table.lengths[ids_arr], out=starts[1:])
    bins = table.bins_table(vocab)[ids_arr]
    coord_at = np.flatnonzero(bins >= 0)
    n_spans = len(rendered.coord_spans)
    coord_spans = np.fromiter(chain.from_iterable(rendered.coord_spans), np.int64, 3 * n_spans).reshape(-1, 3)
    expected, expected_starts = coord_spans[:, 0], coord_spans[:, 1]
    if (
        coord_at.size != expected.size
        or not np.array_equal(bins[coord_at], expected)
        or not np.array_equal(starts[coord_at], expected_starts)
    ):
        raise ValueError(
            f"the append text's {expected.size} coord tokens did not encode one id each at their places "
            f"(found {coord_at.size}); check that the coord tokens are added tokens (CoordVocab.from_tokenizer)"
        )
    n_desc = len(rendered.desc_spans)
    spans = np.fromiter(chain.from_iterable(rendered.desc_spans), np.int64, 2 * n_desc).reshape(-1, 2)
    spans = spans[spans[:, 1] > spans[:, 0]]
    spans[:, 1] -= 1  # the last byte of each desc value
    first, last = (np.searchsorted(starts, spans, side="right") - 1).T  # the tokens holding them
    count = last - first + 1
    desc = np.repeat(first - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))  # every [first, last]
    return coord_at, np.unique(desc), starts


def _ce_weights(
    parse: RolloutParse,
    pairs: list[tuple[int, int]],
    token_ce: TokenCeConfig,
    prefix_len: int,
    append_len: int,
    coord_at: np.ndarray,
    desc_at: np.ndarray,
    unsupervised_head: int = 0,
    tail_roles: np.ndarray | None = None,
    desc_taught: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted CE positions and float32 weights: matched prefix structure, FN-tail structure (1), FN descs, EOS (1).

    Later groups overwrite earlier ones at a shared position, except FN descs, which only fill free positions. The
    first ``unsupervised_head`` append tokens hold bytes of an entry that is not a valid object: never trained.
    ``tail_roles`` (per append token: 0 taught as the append, 1 a re-serialized matched object's structure, 2 no
    loss) narrows the tail's structure supervision when the tail is not the plain append (:class:`TailEntry`).
    """
    n = prefix_len + append_len + 1
    weight = np.full(n, np.nan)
    struct_weight = float(token_ce.rollout_matched_prefix_struct_weight)
    if struct_weight > 0:
        prefix_struct = [pos for p, _ in pairs for pos in parse.objects[p].struct_token_positions
                         if pos < prefix_len or pos >= len(parse.prefix_ids)]  # a joined cut token is tail now
        outside = [pos for pos in prefix_struct if not 0 <= pos < n]
        if outside:
            raise ValueError(
                f"ce_positions {sorted(set(outside))[:5]} lie outside the assistant ids [0, {n}); the supervision was "
                "built for another sequence (prefix/append misalignment)"
            )
        weight[prefix_struct] = struct_weight
    tail_struct = np.ones(append_len, dtype=bool)
    tail_struct[coord_at] = False
    tail_struct[desc_at] = False
    tail_struct[:unsupervised_head] = False
    if tail_roles is not None:
        matched_struct = tail_struct & (tail_roles == 1)
        tail_struct &= tail_roles == 0
        if struct_weight > 0:
            weight[prefix_len + np.flatnonzero(matched_struct)] = struct_weight
    weight[prefix_len + np.flatnonzero(tail_struct)] = 1.0
    desc_weight = float(token_ce.rollout_fn_desc_weight)
    if desc_weight > 0:
        desc_positions = prefix_len + (desc_at if desc_taught is None else desc_taught)
        weight[desc_positions[np.isnan(weight[desc_positions])]] = desc_weight
    weight[n - 1] = 1.0
    positions = np.flatnonzero(~np.isnan(weight))
    return positions, weight[positions].astype(np.float32)


def _token_roles(rendered: RenderedAppend, starts: np.ndarray, tail: Sequence[TailEntry], joined: str) -> np.ndarray:
    """Per append token, the role it is taught in (see :func:`_ce_weights`), by where its last byte lies (what the
    token commits to): in an ``fn`` entry or around the entries (the re-encoded cut token, the closing brace) it is
    taught as the append, in a ``matched`` entry as that entry's structure, in a ``neutral`` one not at all (so
    ``"]},`` that closes an object and opens a neutral one teaches nothing). The separator before the first entry
    belongs to it, as every later entry's own leading ``", "`` does."""
    n_bytes = int(starts[-1])
    label = np.zeros(n_bytes + 1, dtype=np.int8)  # 0 around the entries, else 1 + the entry's role index
    code = {"fn": 0, "matched": 1, "neutral": 2}
    spans = list(rendered.entry_spans)
    if spans:
        spans[0] = (len(joined.encode("utf-8")), spans[0][1])
    for (a, b), entry in zip(spans, tail):
        label[a:b] = 1 + code[entry.role]
    return np.array([0, 0, 1, 2], dtype=np.int8)[label[starts[1:] - 1]]


def _entry_tokens(spans: Sequence[tuple[int, int]], starts: np.ndarray) -> list[np.ndarray]:
    """The token indices holding each byte span (empty spans: none)."""
    out = []
    for a, b in spans:
        if b <= a:
            out.append(np.zeros(0, dtype=np.int64))
            continue
        first = int(np.searchsorted(starts, a, side="right")) - 1
        last = int(np.searchsorted(starts, b - 1, side="right")) - 1
        out.append(np.arange(first, last + 1, dtype=np.int64))
    return out


def _check_tail(tail: Sequence[TailEntry], n_gt: int, matched_gt: set[int]) -> tuple[TailEntry, ...]:
    """The tail entries, checked: every ``fn`` entry a distinct ground-truth object no prefix pair holds, every
    ``matched`` entry with one finite target bin in [0, 999] per coord."""
    entries = tuple(tail)
    seen: set[int] = set()
    for k, entry in enumerate(entries):
        if entry.role not in ("fn", "matched", "neutral"):
            raise ValueError(f"tail entry {k}: role must be fn, matched or neutral, got {entry.role!r}")
        if entry.role == "fn":
            g = entry.gt_index
            if g is None or not 0 <= g < n_gt or g in matched_gt or g in seen:
                raise ValueError(f"tail entry {k}: fn gt_index {g!r} must be a ground-truth object (0..{n_gt - 1}) "
                                 "that no prefix pair and no other tail entry holds")
            seen.add(g)
        if entry.role == "matched":
            values = np.asarray(entry.coord_targets, dtype=np.float64)
            if values.shape != (len(entry.obj.coords),) or not np.isfinite(values).all() or (
                    values.size and (values.min() < 0 or values.max() > 999)):
                raise ValueError(f"tail entry {k}: a matched entry needs one finite target bin in [0, 999] per coord "
                                 f"({len(entry.obj.coords)}), got {list(entry.coord_targets)}")
    return entries


def _join_at_cut(parse: RolloutParse, table: PieceTable) -> tuple[tuple[int, ...], str]:
    """``(kept ids, joined text)``: the rollout ids kept unchanged, and the text of the re-encoded cut token (or of
    the ``{`` fallback) that is encoded TOGETHER with the append, so the join is tokenized as the tokenizer
    tokenizes the whole text (``"]}}`` stays one token when nothing is appended), never as ``"]}`` + ``}``
    (docs/design.md, target construction). Only a replacement the parser chose is joined; kept ids never change."""
    replaced = parse.prefix_ids[parse.n_kept:]
    if not replaced:
        return parse.prefix_ids, ""
    try:
        joined = table.text_of(replaced).decode("utf-8")
    except UnicodeDecodeError:  # a partial UTF-8 piece: keep the parser's replacement as its own tokens
        return parse.prefix_ids, ""
    return parse.prefix_ids[: parse.n_kept], joined


def _tokens_closing_an_invalid_entry(parse: RolloutParse, joined: str, append_ids: Sequence[int],
                                     table: PieceTable) -> int:
    """How many leading append tokens overlap ``joined`` when it closes an entry that is not a valid object (an
    invalid object, or a dict under a key that is no ``object_N``): their closing must not be taught."""
    if not joined or parse.n_kept == 0:  # nothing joined, or the "{" fallback (all of it is the tail)
        return 0
    last = parse.objects[-1] if parse.objects else None
    if last is not None and last.valid and last.token_span[1] == len(parse.prefix_ids):
        return 0
    n_bytes, covered = len(joined.encode("utf-8")), 0
    for count, token in enumerate(append_ids, start=1):
        covered += len(table.pieces[token])
        if covered >= n_bytes:
            return count
    return len(append_ids)


def encode_append(rendered: RenderedAppend, tokenizer: Any, vocab: CoordVocab, table: PieceTable) -> tuple[int, ...]:
    """``tokenizer.encode(rendered.text)``, assembled from cached encodings of the text between coord tokens.

    Coord tokens are added tokens, which the tokenizer splits out before anything else, so the result is identical;
    ``PieceTable.splits_at_added_tokens`` checks that once per tokenizer and otherwise the whole text is encoded.
    """
    if not rendered.coord_spans or not table.splits_at_added_tokens(tokenizer.convert_ids_to_tokens(vocab.ids[0])):
        return tuple(int(i) for i in tokenizer.encode(rendered.text, add_special_tokens=False))
    coord_ids = vocab.ids
    return table.encode_joined(rendered.segments, [coord_ids[value] for value, _, _ in rendered.coord_spans])


def render_tail(objects: Sequence[DetObject], start_index: int, field_order: FieldOrder, joined: str,
                prefix_text: str) -> RenderedAppend:
    """The text ``Y_train`` continues with after its kept ids: the re-encoded cut token (``joined``), the comma rule
    of SerializeAppend, ``objects`` numbered from ``start_index``, and the closing brace."""
    return render_entries(objects, start_index, field_order, lead=joined + append_lead(prefix_text, len(objects)),
                          tail="}")


def build_train_target(
    parse: RolloutParse,
    gt_objects: Sequence[DetObject],
    matched_pairs: Sequence[tuple[int, int]],
    pair_coord_targets: Mapping[tuple[int, int], Any] | Sequence[Any],
    tokenizer: Any,
    vocab: CoordVocab,
    *,
    field_order: FieldOrder,
    token_ce: TokenCeConfig,
    eos_id: int,
    piece_table: PieceTable | None = None,
    tail: Sequence[TailEntry] | None = None,
) -> TrainTarget:
    """Assemble ``Y_train`` and its supervision.

    ``matched_pairs`` holds ``(position in parse.objects, gt index)``; ``pair_coord_targets`` gives, per pair, one
    target bin per coord slot of the prediction (a mapping keyed by the pair, or a sequence in pair order). GT
    objects not matched are appended in GT order, numbered from ``max_object_index + 1``; ``tail`` replaces that
    append by the given entries (FN placement and repeat removal, docs/design.md, decision 18).
    """
    table = piece_table if piece_table is not None else PieceTable.for_tokenizer(tokenizer)
    eos_id = int(eos_id)
    if not 0 <= eos_id < len(table.pieces) or vocab.is_coord(eos_id):
        raise ValueError(f"eos_id {eos_id} must be a non-coord token id of this tokenizer (e.g. <|im_end|>)")
    original = [(int(p), int(g)) for p, g in matched_pairs]
    pairs = _check_pairs(parse, len(gt_objects), original)
    pair_targets = _pair_targets(parse, pairs, pair_coord_targets, original)
    matched_gt = {g for _, g in pairs}
    if tail is None:  # the spec's tail: every missed object, in ground-truth order
        tail = tuple(TailEntry(gt_objects[g], "fn", g) for g in range(len(gt_objects)) if g not in matched_gt)
    entries = _check_tail(tail, len(gt_objects), matched_gt)
    fn = tuple(int(e.gt_index) for e in entries if e.role == "fn")
    start_index = (parse.max_object_index or 0) + 1
    kept_ids, joined = _join_at_cut(parse, table)
    rendered = render_tail([e.obj for e in entries], start_index, field_order, joined, parse.prefix_text)
    append_ids = encode_append(rendered, tokenizer, vocab, table)
    coord_at, desc_at, starts = _append_token_layout(append_ids, rendered, table, vocab)
    roles = _token_roles(rendered, starts, entries, joined)
    fn_descs = [span for span, e in zip(rendered.desc_spans, entries) if e.role == "fn"]
    desc_taught = np.unique(np.concatenate([np.zeros(0, np.int64), *_entry_tokens(fn_descs, starts)]))

    prefix_len, append_len = len(kept_ids), len(append_ids)
    ids = kept_ids + append_ids + (eos_id,)
    ce_positions, ce_weights = _ce_weights(parse, pairs, token_ce, prefix_len, append_len, coord_at, desc_at,
                                           _tokens_closing_an_invalid_entry(parse, joined, append_ids, table),
                                           tail_roles=roles, desc_taught=desc_taught)

    # Coord slots: the matched predictions' slots in pair order, then the tail's taught ones; bbox_slots index them.
    coord_positions: list[int] = []
    bbox_first: list[int] = []  # the slot of each supervised box's x1
    for p, _ in pairs:
        obj = parse.objects[p]
        if obj.geometry == "bbox_2d":
            bbox_first.append(len(coord_positions))
        coord_positions += obj.coord_token_indices
    tail_positions: list[int] = []
    tail_values: list[float] = []
    offset = 0
    for geometry, entry in zip(rendered.geometries, entries):
        n_coords = len(entry.obj.coords)
        if entry.role != "neutral":
            if geometry == "bbox_2d":
                bbox_first.append(len(coord_positions) + len(tail_positions))
            tail_positions += (prefix_len + coord_at[offset:offset + n_coords]).tolist()
            tail_values += ([b for b, _, _ in rendered.coord_spans[offset:offset + n_coords]] if entry.role == "fn"
                            else list(entry.coord_targets))
        offset += n_coords
    coord_positions += tail_positions
    tail_bins = np.array(tail_values, dtype=np.float64)

    supervision = TokenSupervision(
        ce_positions=ce_positions,
        ce_weights=ce_weights,
        coord_positions=np.array(coord_positions, dtype=np.int64),
        coord_targets=np.concatenate([pair_targets, tail_bins]).astype(np.float32),
        bbox_slots=(np.array(bbox_first, dtype=np.int64)[:, None] + np.arange(4, dtype=np.int64)).reshape(-1, 4),
    )
    target = TrainTarget(
        ids=ids,
        prefix_len=prefix_len,
        append_len=append_len,
        supervision=supervision,
        matched_pairs=tuple(pairs),
        fn_gt_indices=fn,
        start_index=start_index,
        append_text=rendered.text[len(joined):],
        joined_text=joined,
        n_ambiguous=parse.n_ambiguous,
        prefix_fallback=parse.prefix_fallback,
        cut_fallbacks=parse.cut_fallbacks,
        truncated=parse.truncated,
        tail=() if tail is None else entries,
    )
    check_supervision_in_span(target)
    return target


def check_supervision_in_span(target: TrainTarget) -> None:
    """Raise if any supervised position falls outside ``[0, len(ids))`` or the supervision is inconsistent."""
    sup, n = target.supervision, len(target.ids)
    for name, positions in (("ce_positions", sup.ce_positions), ("coord_positions", sup.coord_positions)):
        if positions.dtype.kind in "iu" and (not positions.size or (positions.min() >= 0 and positions.max() < n)):
            continue  # integer positions all inside: two reductions instead of a mask
        outside = positions[(positions < 0) | (positions >= n)]
        if outside.size:
            raise ValueError(
                f"{name} {outside[:5].tolist()} lie outside the assistant ids [0, {n}); the supervision was built "
                "for another sequence (prefix/append misalignment)"
            )
    if sup.ce_positions.shape != sup.ce_weights.shape or sup.coord_positions.shape != sup.coord_targets.shape:
        raise ValueError("supervision arrays are misaligned: every position needs exactly one weight/target")
    if sup.ce_positions.dtype.kind in "iu" and sup.coord_positions.dtype.kind in "iu":  # both lie in [0, n) here
        text_slot = np.zeros(n, dtype=bool)
        text_slot[sup.ce_positions] = True
        overlap = sup.coord_positions[text_slot[sup.coord_positions]]
        overlap = np.unique(overlap) if overlap.size else overlap
    else:
        overlap = np.intersect1d(sup.ce_positions, sup.coord_positions)
    if overlap.size:
        raise ValueError(f"positions {overlap[:5].tolist()} are supervised both as text (CE) and as coord slots")
    if sup.bbox_slots.size and (sup.bbox_slots.min() < 0 or sup.bbox_slots.max() >= sup.coord_positions.size):
        raise ValueError("bbox_slots point outside coord_positions")
