"""Per-group host pipeline of the reward objective (docs/design.md, decision 19): one image's rollouts -> parse and
match (the rollout-matching pipeline, :func:`build_rollout_sample`) -> outcomes -> group credit -> one
policy-gradient sample per rollout (its own tokens, each with its advantage), plus, with ``reward.sft_weight > 0``,
the rollout-matching SFT sample of the same rollout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

import numpy as np

from coordexp.runtime.core.objects import TokenSupervision
from coordexp.runtime.core.reward import (
    GroupFigures,
    RolloutOutcome,
    closing_positions,
    group_credit,
    group_figures,
    rollout_outcome,
    token_advantages,
)
from coordexp.runtime.core.set_figures import certified_duplicates
from coordexp.runtime.model.encoding import check_supervised_span, encode_teacher_forced
from coordexp.runtime.train.rollout_step import HostContext, SampleTarget, build_rollout_sample

if TYPE_CHECKING:
    from coordexp.runtime.core.parsing import RolloutParse
    from coordexp.runtime.model.data import DetectionRecord
    from coordexp.runtime.model.encoding import EncodedPrompt
    from coordexp.runtime.rollout.base import RolloutOutput

__all__ = ["closed_by_model", "object_spans", "build_reward_group", "build_reward_samples"]

_EMPTY_INT = np.zeros(0, dtype=np.int64)


def closed_by_model(parse: "RolloutParse", output: "RolloutOutput") -> bool:
    """Whether the model itself ended its turn: a stop it sampled, not a length cut nor the repeat guard's EOS."""
    return output.finish_reason == "stop" or (parse.stopped_at_eos and output.finish_reason != "repeat")


def object_spans(parse: "RolloutParse", positions: Sequence[int]) -> list[tuple[int, int]]:
    """The rollout-token span ``[start, end)`` of each parsed object at ``positions``. A span the parser reports in
    prefix coordinates past ``n_kept`` (the last object's fused closing token, re-encoded) ends at the rollout token
    that held it, ``n_kept + 1``."""
    spans = []
    for position in positions:
        start, end = parse.objects[position].token_span
        spans.append((start, end if end <= parse.n_kept else parse.n_kept + 1))
    return spans


def _policy_sample(record: "DetectionRecord", prompt: "EncodedPrompt", sft: SampleTarget, ids: tuple[int, ...],
                   advantages: np.ndarray, ctx: HostContext) -> SampleTarget:
    """The rollout's own tokens teacher-forced, every one a policy-gradient token with its advantage."""
    supervision = TokenSupervision(
        ce_positions=_EMPTY_INT, ce_weights=np.zeros(0, np.float32), coord_positions=_EMPTY_INT,
        coord_targets=np.zeros(0, np.float32), bbox_slots=np.zeros((0, 4), np.int64),
        pg_positions=np.arange(len(ids), dtype=np.int64), pg_advantages=advantages.astype(np.float32))
    target = replace(sft.target, ids=ids, prefix_len=len(ids), append_len=0, supervision=supervision,
                     fn_gt_indices=(), tail=())
    encoded = encode_teacher_forced(ctx.processor, record, ctx.template, ids, prompt=prompt)
    check_supervised_span(supervision.pg_positions + encoded.assistant_start, encoded.prompt_len,
                          encoded.total_len, what=f"{record.source} policy-gradient")
    return replace(sft, encoded=encoded, target=target)


def build_reward_group(record: "DetectionRecord", prompt: "EncodedPrompt", outputs: Sequence["RolloutOutput"],
                       ctx: HostContext) -> tuple[list[SampleTarget], GroupFigures]:
    """One image's group: a policy-gradient sample per rollout (carrying the rollout's counters), then, with
    ``reward.sft_weight > 0``, each rollout's SFT sample (no counters: the rollout is counted once)."""
    cfg = ctx.rollout.reward
    gts = list(record.objects)
    built: list[tuple[SampleTarget, bool]] = []
    outcomes: list[RolloutOutcome] = []
    for output in outputs:
        sft = build_rollout_sample(record, prompt, output, ctx)
        parse = sft.parse
        preds = [parse.objects[i].to_det_object() for i in sft.valid_positions]
        closed = closed_by_model(parse, output)
        outcomes.append(rollout_outcome(preds, gts, sft.match.pairs, certified_duplicates(preds, gts), closed=closed,
                                        iou_threshold=cfg.iou_threshold, class_aware=cfg.class_aware))
        built.append((sft, closed))
    credits = group_credit(outcomes, cfg)
    policy, placed = [], []
    for (sft, closed), credit in zip(built, credits, strict=True):
        parse = sft.parse
        ids = tuple(parse.response_ids) + ((ctx.eos_id,) if closed else ())
        if not ids:
            continue  # nothing generated and no stop: no token to credit
        advantages = token_advantages(object_spans(parse, sft.valid_positions), credit, len(ids),
                                      closing_positions(parse.response_ids, ctx.pieces, closed))
        placed.append(advantages)
        policy.append(_policy_sample(record, prompt, sft, ids, advantages, ctx))
    samples = policy
    if cfg.sft_weight > 0:
        samples = samples + [replace(sft, counters=None) for sft, _ in built]
    return samples, group_figures(credits, placed)


def build_reward_samples(records: Sequence["DetectionRecord"], prompts: Sequence["EncodedPrompt"],
                         outputs: Sequence["RolloutOutput"], ctx: HostContext, group: int, version: int | None
                         ) -> tuple[list[SampleTarget], list[GroupFigures]]:
    """Every group of ``group`` consecutive requests (one image's rollouts, as :meth:`expand` lays them out)."""
    if not len(records) == len(prompts) == len(outputs) or len(records) % group:
        raise ValueError(f"{len(records)} records, {len(prompts)} prompts and {len(outputs)} outputs do not form "
                         f"groups of {group}")
    samples: list[SampleTarget] = []
    figures: list[GroupFigures] = []
    for start in range(0, len(records), group):
        if any(r is not records[start] for r in records[start:start + group]):
            raise ValueError(f"requests {start}..{start + group - 1} are not one image's group")
        part, fig = build_reward_group(records[start], prompts[start], outputs[start:start + group], ctx)
        samples.extend(replace(s, policy_version=version) for s in part)
        figures.append(fig)
    return samples, figures
