"""Rewards and advantages of stage 2's reward objective (docs/design.md, decision 19): pure arithmetic over what the
matching already knows about each rollout (which object found which ground truth, which is a certified repeat,
where the list closed).

Two credit forms, both over a group of rollouts of one image:

- ``sequence`` (the peers' form, the baseline): one reward per rollout, ``found / max(#GT, 1) - duplicate_penalty *
  repeats - spurious_penalty * spurious``; its advantage is the reward minus the leave-one-out mean of the group's
  other rewards (optionally over the group's standard deviation), on every token of the rollout.
- ``object`` (ours): each object's tokens carry that object's advantage and the closing tokens the stop advantage.
  A found object (ground truth ``g`` at IoU ``u``) gets ``u`` minus the leave-one-out mean of the IoU the group's
  other rollouts reached on ``g`` (0 where they missed it): credit for finding or placing ``g`` better than the peers.
  A certified repeat gets ``-duplicate_penalty``, any other unmatched object ``-spurious_penalty`` (default 0:
  labels are incomplete), the closing tokens ``-stop_penalty`` per ground-truth object still missing when the list
  closed, or ``+close_bonus`` when nothing was missing. A rollout cut off before it closed (length limit, repeat
  guard) carries ``-stop_penalty * missing - cutoff_penalty`` on its last token: never closing must never beat
  closing early. Repeats and spurious objects are not baselined; closings are only with ``baseline_closing``
  (an unbaselined negative close lowers the close's probability whatever the alternative is worth: measured, the
  list ran on; a baselined one moves it only where the group's rollouts closed differently).

A group whose rollouts are equally good (equal sequence rewards; equal IoU on every ground-truth object) carries
zero baselined advantage, so it adds no policy-gradient update from those terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, Sequence

import numpy as np

from coordexp.runtime.core.matching import aabb_iou_matrix
from coordexp.runtime.core.objects import DetObject

if TYPE_CHECKING:
    from coordexp.runtime.core.pieces import PieceTable

__all__ = ["RewardSettings", "ObjectOutcome", "RolloutOutcome", "rollout_outcome", "sequence_reward",
           "closing_reward", "leave_one_out_advantages", "RolloutCredit", "group_credit", "GroupFigures",
           "group_figures", "closing_positions", "token_advantages"]

ObjectKind = Literal["found", "repeat", "spurious"]
# advantages over a group's standard deviation: below this spread the group counts as equal (no division)
_MIN_STD = 1e-6


class RewardSettings(Protocol):
    """The ``rollout_matching.reward`` fields this module reads (the schema's ``RewardConfig``)."""

    credit: Literal["sequence", "object"]
    iou_threshold: float
    class_aware: bool
    duplicate_penalty: float
    spurious_penalty: float
    stop_penalty: float
    close_bonus: float
    cutoff_penalty: float
    baseline_closing: bool
    scale_by_std: bool


@dataclass(frozen=True)
class ObjectOutcome:
    """One valid object of a rollout: found (``gt`` at ``iou``), a certified repeat, or spurious."""

    kind: ObjectKind
    gt: int | None = None
    iou: float = 0.0


@dataclass(frozen=True)
class RolloutOutcome:
    """What the reward reads from one rollout: its valid objects in order, the ground truth count, and whether
    the model closed the list itself (ended its turn; a length cut or a forced stop is no closing decision)."""

    objects: tuple[ObjectOutcome, ...]
    gt_count: int
    closed: bool

    @property
    def found(self) -> int:
        return sum(o.kind == "found" for o in self.objects)

    @property
    def missing(self) -> int:
        return self.gt_count - self.found

    def count(self, kind: ObjectKind) -> int:
        return sum(o.kind == kind for o in self.objects)

    def iou_on(self, gt: int) -> float:
        """The IoU this rollout reached on ground truth ``gt`` (0 when it did not find it)."""
        return next((o.iou for o in self.objects if o.kind == "found" and o.gt == gt), 0.0)


def rollout_outcome(preds: Sequence[DetObject], gts: Sequence[DetObject], pairs: Sequence[tuple[int, int]],
                    repeats: Sequence[bool], *, closed: bool, iou_threshold: float, class_aware: bool
                    ) -> RolloutOutcome:
    """Each prediction's outcome from the stage-2 matcher's one-to-one ``pairs`` (pred, gt) and the certified
    repeats: a pair is found at box IoU >= ``iou_threshold`` (and the same desc when ``class_aware``); an unpaired
    or failing prediction is a repeat when certified, else spurious."""
    if len(repeats) != len(preds):
        raise ValueError(f"{len(repeats)} repeat flags for {len(preds)} predictions")
    ious = aabb_iou_matrix(preds, gts) if len(preds) and len(gts) else np.zeros((len(preds), len(gts)))
    partner = {int(p): int(g) for p, g in pairs}
    out = []
    for k, pred in enumerate(preds):
        g = partner.get(k)
        if g is not None and ious[k, g] >= iou_threshold and (not class_aware or pred.desc == gts[g].desc):
            out.append(ObjectOutcome("found", g, float(ious[k, g])))
        else:
            out.append(ObjectOutcome("repeat" if repeats[k] else "spurious"))
    return RolloutOutcome(tuple(out), len(gts), bool(closed))


def sequence_reward(outcome: RolloutOutcome, cfg: RewardSettings) -> float:
    """``found / max(#GT, 1) - duplicate_penalty * repeats - spurious_penalty * spurious``."""
    return (outcome.found / max(outcome.gt_count, 1) - cfg.duplicate_penalty * outcome.count("repeat")
            - cfg.spurious_penalty * outcome.count("spurious"))


def closing_reward(outcome: RolloutOutcome, cfg: RewardSettings) -> float:
    """The closing tokens' advantage: ``-stop_penalty * missing`` when the list closed with ground truth missing,
    ``+close_bonus`` when it closed with nothing missing; ``-stop_penalty * missing - cutoff_penalty`` on the last
    token of a rollout the model did not close (cut off: worse than closing at the same point)."""
    if not outcome.closed:
        return -cfg.stop_penalty * outcome.missing - cfg.cutoff_penalty
    return -cfg.stop_penalty * outcome.missing if outcome.missing > 0 else cfg.close_bonus


def leave_one_out_advantages(values: Sequence[float], scale_by_std: bool = False) -> np.ndarray:
    """``v_i - mean_{k != i} v_k`` per member (optionally over the group's population standard deviation; a
    group spread below 1e-6 is left unscaled). A group of one has no peer: its advantage is 0."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    n = v.size
    if n < 2:
        return np.zeros(n)
    d = v - v[0]  # the advantage ignores a shift; this one makes a group of equal values exactly 0
    adv = d - (d.sum() - d) / (n - 1)
    if scale_by_std:
        std = float(v.std())
        adv = adv / std if std > _MIN_STD else np.zeros(n)
    return adv


@dataclass(frozen=True)
class RolloutCredit:
    """One rollout's credit: its reward, an advantage per valid object (appearance order), the closing tokens'
    advantage (sequence credit: None when not closed) and, for sequence credit, the one advantage every token
    carries."""

    reward: float
    object_advantages: tuple[float, ...]
    closing_advantage: float | None
    sequence_advantage: float | None = None


def group_credit(outcomes: Sequence[RolloutOutcome], cfg: RewardSettings) -> list[RolloutCredit]:
    """The credit of each rollout of one image's group (module doc)."""
    rewards = [sequence_reward(o, cfg) for o in outcomes]
    if cfg.credit == "sequence":
        advantages = leave_one_out_advantages(rewards, cfg.scale_by_std)
        return [RolloutCredit(r, (float(a),) * len(o.objects), float(a) if o.closed else None, float(a))
                for r, a, o in zip(rewards, advantages, outcomes, strict=True)]
    gt_count = max((o.gt_count for o in outcomes), default=0)
    # per ground-truth object: every rollout's IoU on it, and each rollout's advantage on it over its peers
    on_gt = np.array([[o.iou_on(g) for g in range(gt_count)] for o in outcomes]).reshape(len(outcomes), gt_count)
    gt_adv = np.stack([leave_one_out_advantages(on_gt[:, g], cfg.scale_by_std) for g in range(gt_count)], axis=1) \
        if gt_count else on_gt
    closings = [closing_reward(o, cfg) for o in outcomes]
    if cfg.baseline_closing:
        closings = leave_one_out_advantages(closings, cfg.scale_by_std).tolist()
    credits = []
    for i, (outcome, reward) in enumerate(zip(outcomes, rewards, strict=True)):
        per_object = tuple(float(gt_adv[i, o.gt]) if o.kind == "found" else
                           -cfg.duplicate_penalty if o.kind == "repeat" else -cfg.spurious_penalty
                           for o in outcome.objects)
        credits.append(RolloutCredit(reward, per_object, float(closings[i])))
    return credits


@dataclass(frozen=True)
class GroupFigures:
    """One group's figures for the step log: its rewards' mean and spread, whether every token's advantage is 0,
    and the sums behind the window's advantage and closing means."""

    reward_mean: float
    reward_std: float
    zero_advantage: bool
    samples: int
    advantage_sum: float  # over every credited token of the group
    advantage_tokens: int
    closing_sum: float
    closings: int


def group_figures(credits: Sequence[RolloutCredit], token_advantages: Sequence[np.ndarray]) -> GroupFigures:
    """The figures of one group from its credits and the per-token advantages placed on its rollouts."""
    rewards = np.array([c.reward for c in credits], dtype=np.float64)
    tokens = np.concatenate([np.asarray(a, dtype=np.float64) for a in token_advantages]) if token_advantages \
        else np.zeros(0)
    closing = [c.closing_advantage for c in credits if c.closing_advantage is not None]
    return GroupFigures(
        reward_mean=float(rewards.mean()) if rewards.size else 0.0,
        reward_std=float(rewards.std()) if rewards.size else 0.0,
        zero_advantage=bool(np.all(tokens == 0.0)),
        samples=len(credits),
        advantage_sum=float(tokens.sum()),
        advantage_tokens=int(tokens.size),
        closing_sum=float(sum(closing)),
        closings=len(closing),
    )


def closing_positions(response_ids: Sequence[int], pieces: "PieceTable", closed: bool) -> tuple[int, ...]:
    """The positions of ``response_ids + (EOS,)`` that close the list: when the model ended its turn, the EOS
    (last) position and, when the text before it ends in the list's ``}``, the token holding that brace and any
    after it (the model decides to stop at the structural close, upstream measured, not only at EOS). When the
    model did not close the list (no EOS follows), the last token, where it was cut off."""
    n = len(response_ids)
    if not closed:
        return (n - 1,) if n else ()
    text = pieces.text_of(list(response_ids)) if n else b""
    body = text.rstrip()
    if not body.endswith(b"}"):
        return (n,)
    lengths = [len(pieces.pieces[int(i)]) for i in response_ids]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    brace = int(np.searchsorted(starts, len(body) - 1, side="right")) - 1
    return tuple(range(brace, n + 1))


def token_advantages(object_spans: Sequence[tuple[int, int]], credit: RolloutCredit, n_tokens: int,
                     closing: Sequence[int]) -> np.ndarray:
    """One advantage per trained token (the rollout's tokens, then its EOS when it closed): sequence credit puts
    the rollout's advantage on every token; object credit puts each valid object's advantage on exactly its token
    span ``[start, end)`` (``object_spans``, one per entry of ``credit.object_advantages``), the closing advantage on
    ``closing`` (it wins on a token shared with the last object, e.g. a fused ``}}``) and 0 elsewhere (the opening
    brace, separators, invalid entries)."""
    if credit.sequence_advantage is not None:
        return np.full(n_tokens, credit.sequence_advantage, dtype=np.float64)
    if len(object_spans) != len(credit.object_advantages):
        raise ValueError(f"{len(object_spans)} object spans for {len(credit.object_advantages)} object advantages")
    out = np.zeros(n_tokens, dtype=np.float64)
    for (start, end), advantage in zip(object_spans, credit.object_advantages, strict=True):
        if not 0 <= start <= end <= n_tokens:
            raise ValueError(f"object span [{start}, {end}) lies outside the {n_tokens} trained tokens")
        out[start:end] = advantage
    if credit.closing_advantage is not None and closing:
        out[list(closing)] = credit.closing_advantage
    return out
