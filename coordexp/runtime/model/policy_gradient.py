"""The reward objective's loss (docs/design.md, decision 19): a policy gradient on the rollout tokens, weighted by
each token's advantage, plus (``reward.sft_weight``) the rollout-matching SFT objective of the same rollouts.

``policy_gradient = -sum_t A_t * log p(y_t | y_<t) / N``, the sum over every policy-gradient token of the
micro-step and ``N`` the number of those tokens (token-mean normalisation: a long rollout weighs more than a short
one, and every token, zero-advantage ones included, counts in ``N``). ``log p`` is the full-vocabulary log-softmax
at temperature 1 of the same sanitised logits ``token_ce`` reads, so the gradient on a logit row is
``-A_t / N * (onehot(y_t) - softmax)``; a coordinate token is just a token here (its 999 neighbours are other
classes), which is why the coordinate-distribution losses stay on the SFT side.
"""

from __future__ import annotations

import torch

from coordexp.runtime.model.coord_losses import gathered_row_stats
from coordexp.runtime.model.losses import LossDenominators, ObjectiveResult, SupervisionBatch, compute_objective
from coordexp.schema.pipeline import PipelineConfig
from coordexp.schema.rollout import RepeatUnlikelihoodConfig

__all__ = ["policy_gradient_loss", "reward_objective"]

# rows of the logits whose entropy is computed at once (a figure, no gradient)
_ENTROPY_CHUNK = 256


def policy_gradient_loss(logits: torch.Tensor, batch: SupervisionBatch, coord_ids: torch.Tensor,
                         tokens: int | None = None, *, compute_dtype: torch.dtype = torch.float32
                         ) -> tuple[torch.Tensor, dict[str, float]]:
    """``-sum(A * log p) / tokens`` over ``batch``'s policy-gradient tokens (``tokens``: the micro-step's count,
    default this batch's own) and its figures: the token-mean advantage, log-probability and entropy (nats) of
    the trained tokens. Exactly 0, still backpropagating, when the batch has none."""
    index = batch.pg_logit_index.to(logits.device)
    count = int(index.numel())
    if count == 0:
        return logits.sum() * 0.0, {}
    stats = gathered_row_stats(logits, index, coord_ids, [1.0], labels=batch.pg_labels, compute_dtype=compute_dtype)
    log_p = stats.label_logit - stats.lse[1.0]
    advantages = batch.pg_advantages.to(device=logits.device, dtype=log_p.dtype)
    denominator = max(int(tokens if tokens is not None else count), 1)
    loss = -(advantages * log_p).sum() / denominator
    figures = {"policy_gradient/advantage_mean": float(advantages.mean()),
               "policy_gradient/logp_mean": float(log_p.detach().mean()),
               "policy_gradient/entropy": _entropy(logits, index)}
    return loss.to(torch.float32), figures


@torch.no_grad()
def _entropy(logits: torch.Tensor, index: torch.Tensor) -> float:
    """Mean full-vocabulary entropy of the policy at the trained tokens, a chunk of rows at a time."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    total = 0.0
    for start in range(0, int(index.numel()), _ENTROPY_CHUNK):
        rows = flat.index_select(0, index[start:start + _ENTROPY_CHUNK]).float()
        log_p = torch.log_softmax(torch.nan_to_num(rows, nan=0.0, posinf=1e4, neginf=-1e4), dim=-1)
        total += float(-(log_p.exp() * log_p).sum())
    return total / max(int(index.numel()), 1)


def reward_objective(logits: torch.Tensor, batch: SupervisionBatch, coord_ids: torch.Tensor,
                     pipeline: PipelineConfig, denominators: LossDenominators | None, sft_weight: float,
                     repeat_ul: RepeatUnlikelihoodConfig | None = None) -> ObjectiveResult:
    """``policy_gradient + sft_weight * rollout-matching SFT`` of one forward row; ``denominators`` are the
    micro-step's, so the rows of a packed step add up to the step's loss (decision 8). The SFT part runs only
    with ``sft_weight > 0`` (its segments are then in the batch); its terms are reported under their usual names.
    A step without any policy-gradient token (a ground-truth step, ``gt_step_share``; a validation loss) is plain
    SFT: ``compute_objective`` alone, at weight 1."""
    whole = denominators if denominators is not None else LossDenominators.of(batch)
    if whole.policy_tokens == 0:
        return compute_objective(logits, batch, coord_ids, pipeline, denominators, repeat_ul)
    pg, figures = policy_gradient_loss(logits, batch, coord_ids, whole.policy_tokens)
    total = pg
    # token means weighted by this row's share of the step's tokens: the rows' terms add up to the step's means
    share = int(batch.pg_logit_index.numel()) / max(whole.policy_tokens, 1)
    terms: dict[str, float] = {"policy_gradient": float(pg.detach())}
    terms.update({name: value * share for name, value in figures.items() if name != "policy_gradient/advantage_mean"})
    diagnostics: dict[str, float] = dict(figures)
    counts = {"num_policy_tokens": int(batch.pg_logit_index.numel())}
    if sft_weight > 0:
        sft = compute_objective(logits, batch, coord_ids, pipeline, denominators, repeat_ul)
        total = total + sft_weight * sft.total
        terms.update(sft.terms)
        terms["sft"] = float(sft.total.detach())
        diagnostics.update(sft.diagnostics)
        counts.update(sft.counts)
    return ObjectiveResult(total=total, terms=terms, diagnostics=diagnostics, counts=counts)
