"""Per-sample host pipeline of stage 2 (and the stage-1 target): rollout -> parse -> match -> Y_train -> encoding.

Pure glue over the core modules; the trainer calls it once per sample and packs the results. Both spec sanity
checks run here: the generation prompt ids must equal the teacher-forced prompt slice, and every supervised
position must fall inside the assistant span.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from coordexp.runtime.model.encoding import (
    EncodedPrompt,
    EncodedSample,
    check_prompt_alignment,
    check_supervised_span,
    encode_teacher_forced,
)
from coordexp.runtime.core.matching import MatchResult, match_objects
from coordexp.runtime.core.objects import TokenSupervision
from coordexp.runtime.core.ot import pair_coord_targets
from coordexp.runtime.core.parsing import RolloutParse, cut_after_objects, parse_rollout
from coordexp.runtime.core.pieces import PieceTable
from coordexp.runtime.core.placement import plan_target
from coordexp.runtime.core.set_figures import certified_duplicates
from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.core.targets import TailEntry, TrainTarget, build_train_target
from coordexp.runtime.core.telemetry import RolloutCounters
from coordexp.runtime.core.tokens import CoordVocab
from coordexp.runtime.core.unlikelihood import with_repeat_negatives
from coordexp.runtime.train.visualize import RolloutLogEntry, bounded_text
from coordexp.schema.pipeline import TokenCeConfig

if TYPE_CHECKING:
    from coordexp.runtime.rollout.base import RolloutOutput
    from coordexp.runtime.model.data import DetectionRecord
    from coordexp.schema.contract import RolloutMatchingContract
    from coordexp.schema.data import GtPrefixMix
    from coordexp.schema.template import TemplateConfig

__all__ = ["HostContext", "SampleTarget", "build_rollout_sample", "build_gt_sample", "gt_prefix", "decode_mode_of",
           "label_draft_ids"]

DecodeMode = Literal["greedy", "sampling", "beam"]
# Stage 1 is plain SFT: every token of the GT serialization is trained, desc values included.
_STAGE1_TOKEN_CE = TokenCeConfig(rollout_fn_desc_weight=1.0, rollout_matched_prefix_struct_weight=0.0)
_NO_PREFIX_CE = TokenCeConfig(rollout_fn_desc_weight=0.0, rollout_matched_prefix_struct_weight=0.0)


@dataclass(frozen=True)
class HostContext:
    """What the per-sample pipeline reads; built once per run."""

    processor: Any
    vocab: CoordVocab
    pieces: PieceTable
    eos_id: int
    rollout: "RolloutMatchingContract"
    template: "TemplateConfig"
    max_length: int | None = None  # stage-1 samples longer than this are refused (RunContract.sample_max_length)

    @classmethod
    def create(cls, processor: Any, rollout: "RolloutMatchingContract", template: "TemplateConfig",
               max_length: int | None = None) -> "HostContext":
        tokenizer = processor.tokenizer
        eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if eos_id is None or eos_id == getattr(tokenizer, "unk_token_id", None):
            raise ValueError("the tokenizer has no <|im_end|> token; coordexp trains Qwen-style chat models")
        return cls(
            processor=processor,
            vocab=CoordVocab.from_tokenizer(tokenizer),
            pieces=PieceTable.for_tokenizer(tokenizer),
            eos_id=int(eos_id),
            rollout=rollout,
            template=template,
            max_length=max_length,
        )

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def token_ce(self) -> TokenCeConfig:
        module = self.rollout.pipeline.module("token_ce")
        return module.config if module is not None else _NO_PREFIX_CE


@dataclass(frozen=True)
class SampleTarget:
    """One sample ready to pack: its teacher-forced encoding, supervision and the evidence behind it."""

    encoded: EncodedSample
    target: TrainTarget
    counters: RolloutCounters | None  # None for stage 1 (no rollout)
    parse: RolloutParse | None = None
    match: MatchResult | None = None
    valid_positions: tuple[int, ...] = ()
    policy_version: int | None = None  # optimizer steps of the policy that generated it (None: stage 1, no rollout)

    @property
    def supervision(self) -> TokenSupervision:
        return self.target.supervision

    @property
    def length(self) -> int:
        return self.encoded.total_len

    def log_entry(self, record: "DetectionRecord", step: int, tag: str = "train", tokenizer: Any = None
                  ) -> RolloutLogEntry:
        """The rollout as drawn by ``coordexp show-rollouts`` (predictions are the valid parsed objects); with
        ``tokenizer``, also the raw text the model wrote (bounded) and its token count."""
        preds = () if self.parse is None else tuple(self.parse.objects[i].to_det_object() for i in self.valid_positions)
        pairs = () if self.match is None else tuple(self.match.pairs)
        text = "" if self.parse is None else self.parse.prefix_text
        response = () if self.parse is None else self.parse.response_ids
        raw = "" if tokenizer is None or not response else bounded_text(
            tokenizer.decode(list(response), skip_special_tokens=False))
        return RolloutLogEntry(
            step=step, image=str(record.image_paths[0]), gt=record.objects, predictions=preds, pairs=pairs, text=text,
            tag=tag, raw_text=raw, raw_tokens=len(response),
        )


def decode_mode_of(rollout: "RolloutMatchingContract") -> DecodeMode:
    if rollout.decoding.num_beams > 1:
        return "beam"
    return "sampling" if rollout.decoding.temperature > 0 else "greedy"


def _check_span(ctx_source: str, target: TrainTarget, encoded: EncodedSample) -> None:
    sup = target.supervision
    start = encoded.assistant_start
    for name, positions in (("CE", sup.ce_positions), ("coord", sup.coord_positions),
                            ("unlikelihood", sup.ul_positions)):
        check_supervised_span(
            np.asarray(positions, dtype=np.int64) + start, encoded.prompt_len, encoded.total_len, what=f"{ctx_source} {name}"
        )


def build_rollout_sample(
    record: "DetectionRecord", prompt: EncodedPrompt, rollout: "RolloutOutput", ctx: HostContext
) -> SampleTarget:
    """Stage 2 for one sample: ``Y_train = rollout prefix + FN append + EOS`` with its supervision and counters."""
    check_prompt_alignment(rollout.prompt_token_ids, prompt.input_ids, prompt.prompt_len)
    parse = parse_rollout(rollout.response_token_ids, ctx.tokenizer, ctx.vocab, piece_table=ctx.pieces)
    valid_positions = tuple(i for i, obj in enumerate(parse.objects) if obj.valid)
    preds = [parse.objects[i].to_det_object() for i in valid_positions]
    gts = list(record.objects)
    match = match_objects(preds, gts, ctx.rollout.matching)
    pair_targets = pair_coord_targets(preds, gts, match.pairs, ctx.rollout.ot)
    rm = ctx.rollout
    duplicates = certified_duplicates(preds, gts)  # one pass for the plan and the counters
    plan = plan_target([o.valid for o in parse.objects], preds, valid_positions, gts, match.pairs, pair_targets,
                       placement=rm.fn_placement, repeats=rm.repeats, trailing=rm.trailing_unmatched,
                       duplicates=duplicates)
    target_parse = parse
    if plan.kept < len(parse.objects):
        target_parse = cut_after_objects(parse, plan.kept, ctx.tokenizer, ctx.vocab, piece_table=ctx.pieces)
    pred_at = {position: p for p, position in enumerate(valid_positions)}
    target = build_train_target(
        target_parse,
        gts,
        list(plan.prefix_pairs),
        [pair_targets[(pred_at[position], g)] for position, g in plan.prefix_pairs],
        ctx.tokenizer,
        ctx.vocab,
        field_order=rm.object_field_order,
        token_ce=ctx.token_ce,
        eos_id=ctx.eos_id,
        piece_table=ctx.pieces,
        tail=plan.tail,
    )
    target = with_repeat_negatives(target, target_parse, plan.repeats_at, ctx.tokenizer, ctx.vocab, ctx.pieces,
                                   rm.object_field_order)
    encoded = encode_teacher_forced(ctx.processor, record, ctx.template, target.ids, prompt=prompt)
    _check_span(record.source, target, encoded)
    counters = RolloutCounters.for_sample(
        pred_valid=len(valid_positions),
        drop_reasons=[reason for reason, n in parse.dropped_by_reason.items() for _ in range(n)],
        gt_objects=len(gts),
        matched=len(match.pairs),
        fn_appended=target.n_fn_appended,
        gating_rejections=match.gating_rejections,
        truncated=parse.truncated,
        prefix_fallback=parse.prefix_fallback,
        decode_mode=decode_mode_of(ctx.rollout),
        # backends hand back stop-trimmed ids: the finish reason, not the ids, says the model ended its turn
        eos_stopped=parse.stopped_at_eos or rollout.finish_reason == "stop",
        rollout_tokens=len(rollout.response_token_ids),
        cut_fallbacks=parse.cut_fallbacks,
        trailing_dropped=len(parse.objects) - len(target_parse.objects),
        certified_duplicates=sum(duplicates),
        repeats_removed=plan.repeats_removed,
        repeat_negatives=int(target.supervision.ul_positions.size),
    )
    return SampleTarget(encoded, target, counters, parse, match, valid_positions)


def gt_prefix(n_objects: int, mix: "GtPrefixMix", draw: random.Random) -> tuple[int, ...]:
    """The objects (indices, reading order) a ground-truth sample gives as context, drawn by ``data.gt_prefix_mix``
    (docs/design.md, decision 18); a kind that needs more objects than the record has gives the empty prefix."""
    kind = draw.choices(("none", "random_subset", "leave_one_out", "all"),
                        weights=(mix.none, mix.random_subset, mix.leave_one_out, mix.all))[0]
    if kind == "all":
        return tuple(range(n_objects))
    if kind == "none" or n_objects < 2:
        return ()
    if kind == "leave_one_out":
        left = draw.randrange(n_objects)
        return tuple(k for k in range(n_objects) if k != left)
    return tuple(sorted(draw.sample(range(n_objects), draw.randint(1, n_objects - 1))))


def build_gt_sample(record: "DetectionRecord", prompt: EncodedPrompt, ctx: HostContext,
                    draw: random.Random | None = None) -> SampleTarget:
    """Stage 1 for one sample: the GT serialization, every token supervised (the opening ``{`` included); with
    ``draw`` and a ``data.gt_prefix_mix`` that cuts, a ground-truth prefix given as context and the objects it leaves
    out taught in reading order (a gap-augmented sample).

    Built through the same target builder as stage 2 (the empty prefix ``{`` with every GT object appended, encoded
    together as the tokenizer encodes the whole text), so stage 1 and stage 2 tails tokenize identically.
    """
    mix = ctx.rollout.gt_prefix_mix
    given = () if draw is None or mix.is_plain else gt_prefix(len(record.objects), mix, draw)
    target = _gt_target(record, ctx, given)
    encoded = encode_teacher_forced(ctx.processor, record, ctx.template, target.ids, prompt=prompt,
                                    max_length=ctx.max_length)
    _check_span(record.source, target, encoded)
    return SampleTarget(encoded, target, counters=None)


def label_draft_ids(record: "DetectionRecord", ctx: HostContext) -> tuple[int, ...] | None:
    """The record's ground truth as the model is trained to write it (the stage-1 target ids, EOS included), the
    draft of label-drafted decoding; None when the run does not use it (``hf_generate.label_drafts: false``, or a
    vLLM backend, which would not read it). Under ``null`` the backend decides per device whether to use it."""
    rm = ctx.rollout
    if rm.hf_generate.label_drafts is False or getattr(rm.backend, "kind", "hf") != "hf":
        return None
    return _gt_target(record, ctx, ()).ids


def _gt_target(record: "DetectionRecord", ctx: HostContext, given: tuple[int, ...]) -> TrainTarget:
    """The stage-1 target: ``given`` objects as a context prefix, the others taught in reading order (all when
    ``given`` is empty)."""
    objects = list(record.objects)
    ids: tuple[int, ...] = ()
    if given:
        text = serialize_objects([objects[k] for k in given], ctx.rollout.object_field_order)
        ids = tuple(ctx.tokenizer.encode(text, add_special_tokens=False))
    parse = parse_rollout(ids, ctx.tokenizer, ctx.vocab, piece_table=ctx.pieces)
    tail = None if not given else tuple(TailEntry(objects[g], "fn", g) for g in range(len(objects)) if g not in given)
    return build_train_target(
        parse,
        objects,
        [],
        [],
        ctx.tokenizer,
        ctx.vocab,
        field_order=ctx.rollout.object_field_order,
        token_ce=_STAGE1_TOKEN_CE,
        eos_id=ctx.eos_id,
        piece_table=ctx.pieces,
        tail=tail,
    )
