"""What one logging window of training reports: loss terms, tokens, packing, rollout counters, staleness, seeds,
and (``training.token_type_metrics``) the teacher-forced accuracy and cross-entropy of the trained tokens per type.

:class:`StepStats` sums a rank's micro-steps since the last log; :func:`step_log_values` reduces them over ranks. Every
rank calls the same reductions in the same order (they are collectives), whatever its own numbers are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from coordexp.runtime.core.reward import GroupFigures
from coordexp.runtime.core.telemetry import RolloutCounters, sum_counters
from coordexp.runtime.model.policy_gradient import ENTROPY_SUMS
from coordexp.runtime.model.token_types import TokenTypeSums, TokenTypeWindow

__all__ = ["StepStats", "WindowContext", "reduce_values", "step_log_values"]

logger = logging.getLogger("coordexp.train")


DRAFT_SUMS = ("row_forwards", "generated_tokens", "accepted_tokens")
"""The label-draft sums a window keeps (:class:`coordexp.runtime.rollout.label_drafts.DraftFigures` fields)."""


class StepStats:
    """Sums over the micro-steps since the last log: loss terms (weighted by micro-step), tokens, counters."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.micro_steps = 0
        self.rows = 0  # forward rows (a packed micro-step may train several)
        self.underfilled_rows = 0  # packed rows filled below training.packing_min_fill_ratio
        self.terms: dict[str, float] = {}
        self.trained_tokens = 0
        self.computed_tokens = 0
        self.counters: list[RolloutCounters] = []
        self.seconds: dict[str, float] = {}
        self.seeds: list[int] = []  # this rank's training rollout seeds, in order
        self.staleness: list[int] = []  # per TRAINED sample: optimizer steps since the policy that generated it
        self.stale_dropped = 0  # carried samples dropped for being older than the staleness bound
        self.gt_micro_steps = 0  # stage 2: micro-steps that trained the GT serialization (rollout_matching.gt_step_share)
        self.token_types = TokenTypeWindow()  # trained positions per token type (training.token_type_metrics)
        self.reward_groups: list[GroupFigures] = []  # objective: reward: one per image group rolled out
        self.drafts = [0.0] * len(DRAFT_SUMS)  # label drafts (hf_generate.label_drafts): sums over backend calls
        self.entropy = [0.0] * len(ENTROPY_SUMS)  # objective: reward: the policy's entropy per token type, sums

    def add_drafts(self, metadata: dict[str, Any] | None) -> None:
        """One backend call's label-draft figures (its ``run_metadata()``), when it decoded with drafts."""
        figures = (metadata or {}).get("label_drafts") or {}
        for k, name in enumerate(DRAFT_SUMS):
            self.drafts[k] += float(figures.get(name, 0) or 0)

    def add_entropy(self, diagnostics: dict[str, float]) -> None:
        """One forward row's entropy sums per token type (the reward objective's ``diagnostics``)."""
        for k, name in enumerate(ENTROPY_SUMS):
            self.entropy[k] += float(diagnostics.get(name, 0.0))

    def timed(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def add(self, terms: dict[str, float], trained: int, computed: int, counters: list, rows: int = 1) -> None:
        self.micro_steps += 1
        self.rows += rows
        for key, value in terms.items():
            self.terms[key] = self.terms.get(key, 0.0) + float(value)
        self.trained_tokens += trained
        self.computed_tokens += computed
        self.counters.extend(c for c in counters if c is not None)


def reduce_values(values: list[float], op: str, *, world_size: int, device: Any) -> list[float]:
    """``values`` reduced over ranks (``sum``, ``min`` or ``max``); every rank must call it (a collective)."""
    if world_size <= 1 or not torch.distributed.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    reduce_op = {"sum": torch.distributed.ReduceOp.SUM, "min": torch.distributed.ReduceOp.MIN,
                 "max": torch.distributed.ReduceOp.MAX}[op]
    torch.distributed.all_reduce(tensor, op=reduce_op)
    return tensor.tolist()


@dataclass(frozen=True)
class WindowContext:
    """What :func:`step_log_values` reads besides the stats: the run's shape and this rank's carry state."""

    world_size: int
    device: Any
    stage2: bool
    buffered: int | None  # carried segments on this rank; None when packing is off
    packing_length: int
    min_fill_ratio: float
    fallback_events: int | None  # weight-sync fallbacks so far (server mode), None when the backend has none
    is_main: bool
    token_type_metrics: bool = False  # training.token_type_metrics: every rank reduces the per-type sums
    reward: bool = False  # rollout_matching.objective: reward: every rank reduces the reward figures


def step_log_values(stats: StepStats, ctx: WindowContext) -> dict[str, float]:
    """Loss terms (mean over micro-steps and ranks), counters (summed, ratios from sums), packing, tokens,
    staleness of the trained samples (stage 2), seed range."""
    def reduced(values: list[float], op: str = "sum") -> list[float]:
        return reduce_values(values, op, world_size=ctx.world_size, device=ctx.device)

    keys = sorted(stats.terms)
    # Every rank runs the same modules, so every rank has the same term keys in the same order.
    sums = reduced(
        [stats.terms[k] for k in keys]
        + [stats.micro_steps, stats.trained_tokens, ctx.buffered or 0, stats.computed_tokens, stats.rows,
           stats.underfilled_rows]
    )
    n = len(keys)
    micro = max(sums[n], 1.0)
    logs = {f"loss/{k}": v / micro for k, v in zip(keys, sums[:n])}
    logs["tokens/trained"] = sums[n + 1]
    # positions the forwards computed (padding included): the padded layout's waste is 1 - trained / computed
    logs["tokens/computed"] = sums[n + 3]
    logs.update({f"time/{k}_s": v for k, v in sorted(stats.seconds.items())})  # this rank's wall time per stage
    if ctx.token_type_metrics:
        # token_acc, text_token_acc, coord_token_acc and their *_token_loss over the window's trained positions
        logs.update(TokenTypeSums.from_list(reduced(stats.token_types.to_list())).figures())
    compute = stats.seconds.get("forward", 0.0) + stats.seconds.get("backward", 0.0)
    if compute > 0:
        logs["tokens/trained_per_s"] = stats.trained_tokens / compute  # this rank, forward + backward only
    if ctx.buffered is not None and stats.micro_steps:
        rows, underfilled = max(sums[n + 4], 1.0), sums[n + 5]
        # trained tokens over the row capacity of every packed forward row (all ranks)
        logs["packing/fill_ratio"] = sums[n + 1] / (rows * ctx.packing_length)
        logs["packing/buffered"] = sums[n + 2]  # carried segments, all ranks
        logs["packing/rows"] = rows  # forward rows, all ranks (several per micro-step when a step overflows one)
        logs["packing/underfilled_rows"] = underfilled  # what to change: said once (MicroStepPipeline)
    if not ctx.stage2:
        return logs
    # optimizer steps between the generating policy and the trained one, per trained sample (all ranks)
    (worst,) = reduced([float(max(stats.staleness, default=0))], "max")
    total, count, dropped, gt_steps = reduced([float(sum(stats.staleness)), float(len(stats.staleness)),
                                               float(stats.stale_dropped), float(stats.gt_micro_steps)])
    if count:
        logs["rollout/staleness_max"], logs["rollout/staleness_mean"] = worst, total / count
    logs["rollout/stale_dropped"] = dropped
    logs["stage2/gt_micro_steps"] = gt_steps  # all ranks: micro-steps that trained the ground truth, not rollouts
    counters = sum_counters(stats.counters) if stats.counters else RolloutCounters()
    if ctx.world_size > 1 and torch.distributed.is_initialized():
        tensor = counters.to_tensor().to(ctx.device)
        torch.distributed.all_reduce(tensor)
        counters = RolloutCounters.from_tensor(tensor.cpu())
    logs.update(counters.to_log_dict(prefix="rollout/"))
    # the lowest and highest rollout seed of the window over all ranks (every seed is in the run log)
    (first,) = reduced([float(min(stats.seeds, default=float("inf")))], "min")
    (last,) = reduced([float(max(stats.seeds, default=float("-inf")))], "max")
    if first != float("inf"):
        logs["rollout/seed_first"], logs["rollout/seed_last"] = first, last
    if ctx.fallback_events is not None:
        logs["rollout/sync_fallbacks"] = float(ctx.fallback_events)
    row_forwards, generated, accepted = reduced(stats.drafts)
    if row_forwards and generated:  # label-drafted rollouts in this window (all ranks)
        logs["rollout/draft_accepted_per_forward"] = accepted / row_forwards
        logs["rollout/draft_token_share"] = accepted / generated
        logs["rollout/forwards_per_token"] = row_forwards / generated
    if ctx.reward:
        logs.update(reward_log_values(stats, reduced))
    return logs


def reward_log_values(stats: StepStats, reduced: Any) -> dict[str, float]:
    """The reward objective's window (all ranks): per image group, the mean reward and its spread, averaged over
    groups; the share of groups whose every advantage is 0 (they teach nothing); the token-mean advantage; the
    mean closing-token advantage; samples per second of this window's step time (rollout, host, forward,
    backward) summed over ranks; the policy's mean entropy (nats) at the trained coordinate and text tokens."""
    groups = stats.reward_groups
    seconds = sum(stats.seconds.get(k, 0.0) for k in ("rollout", "host", "forward", "backward"))
    sums = reduced([float(len(groups)), sum(g.reward_mean for g in groups), sum(g.reward_std for g in groups),
                    float(sum(g.zero_advantage for g in groups)), float(sum(g.samples for g in groups)),
                    sum(g.advantage_sum for g in groups), float(sum(g.advantage_tokens for g in groups)),
                    sum(g.closing_sum for g in groups), float(sum(g.closings for g in groups)),
                    float(sum(g.samples for g in groups) / seconds) if seconds > 0 else 0.0, *stats.entropy])
    if not sums[0]:  # a ground-truth window (gt_step_share): no group was rolled out, so no reward to log (a 0
        return {}     # there read as "the policy earned nothing" and halved every mean over the run)
    n, samples, tokens, closings = sums[0], sums[4], max(sums[6], 1.0), sums[8]
    logs = {"reward/groups": sums[0], "reward/mean": sums[1] / n, "reward/group_std": sums[2] / n,
            "reward/zero_advantage_group_share": sums[3] / n, "reward/samples": samples,
            "reward/advantage_mean": sums[5] / tokens, "reward/samples_per_s": sums[9]}
    if closings:
        logs["reward/closing_advantage"] = sums[7] / closings
    coord_sum, coord_tokens, text_sum, text_tokens = sums[10:14]
    if coord_tokens:
        logs["reward/entropy_coord"] = coord_sum / coord_tokens
    if text_tokens:
        logs["reward/entropy_text"] = text_sum / text_tokens
    return logs
