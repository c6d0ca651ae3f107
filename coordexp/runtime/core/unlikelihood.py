"""Where ``Y_train`` pushes against a certified repeat: the first token at which writing the repeat again would leave
the clean target (docs/design.md, decision 18; ``rollout_matching.repeats: unlikelihood``).

The target is the one ``repeats: drop`` builds (the repeat left out). For each removed repeat, the tail is rendered
again with the repeat back where it stood and encoded as the target's tail is; the first token where the two
encodings differ is the negative, at the label position where the clean target has its own token there. So a repeat
of an object's desc and first coordinates is pushed down at the coordinate where it starts to repeat, and a repeat
written instead of closing the list is pushed down at the token that would have continued it. Negatives are collapsed
per (position, token), as upstream's clean-prefix unlikelihood does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.parsing import RolloutParse
from coordexp.runtime.core.pieces import PieceTable
from coordexp.runtime.core.serialize import FieldOrder
from coordexp.runtime.core.targets import TrainTarget, encode_append, render_tail
from coordexp.runtime.core.tokens import CoordVocab

__all__ = ["first_divergence", "with_repeat_negatives"]


def first_divergence(clean: Sequence[int], other: Sequence[int]) -> int | None:
    """The first index where the two id sequences differ (the shorter one's length when one prefixes the other);
    None when they are equal."""
    n = min(len(clean), len(other))
    a = np.asarray(clean[:n], dtype=np.int64)
    b = np.asarray(other[:n], dtype=np.int64)
    differ = np.flatnonzero(a != b)
    if differ.size:
        return int(differ[0])
    return None if len(clean) == len(other) else n


def with_repeat_negatives(target: TrainTarget, parse: RolloutParse, repeats_at: Sequence[tuple[int, DetObject]],
                          tokenizer: Any, vocab: CoordVocab, table: PieceTable, field_order: FieldOrder
                          ) -> TrainTarget:
    """``target`` with one unlikelihood negative per removed repeat (collapsed per position and token).

    ``parse`` is the cut parse the target was built from and ``repeats_at`` the plan's (tail entries before the
    repeat, the repeat). A negative whose position is the clean target's EOS, or that is the clean token itself,
    cannot arise (the repeat adds an entry); a repeat whose rendering does not diverge adds nothing.
    """
    if not repeats_at:
        return target
    entries = [entry.obj for entry in target.tail]
    clean = target.ids[target.prefix_len:]
    bins_of = table.bins_table(vocab)
    sup = target.supervision
    coord_target_at = dict(zip(sup.coord_positions.tolist(), sup.coord_targets.tolist()))
    found: dict[tuple[int, int], tuple[int, int]] = {}  # (position, token) -> (bin, exclude)
    for index, obj in repeats_at:
        alternative = entries[:index] + [obj] + entries[index:]
        rendered = render_tail(alternative, target.start_index, field_order, target.joined_text, parse.prefix_text)
        other = encode_append(rendered, tokenizer, vocab, table)
        at = first_divergence(clean, other)
        if at is None or at >= len(other) or at >= len(clean) - 1:
            continue
        token, position = int(other[at]), target.prefix_len + at
        neg_bin = int(bins_of[token])
        if position in coord_target_at:
            exclude = int(round(coord_target_at[position]))
        else:
            exclude = int(bins_of[clean[at]]) if neg_bin >= 0 else -1
        found.setdefault((position, token), (neg_bin, exclude))
    if not found:
        return target
    keys = sorted(found)
    values = [found[k] for k in keys]
    supervision = replace(
        sup,
        ul_positions=np.array([p for p, _ in keys], dtype=np.int64),
        ul_tokens=np.array([t for _, t in keys], dtype=np.int64),
        ul_bins=np.array([b for b, _ in values], dtype=np.int64),
        ul_exclude=np.array([e for _, e in values], dtype=np.int64),
    )
    return replace(target, supervision=supervision)
