"""The reward objective's loss (docs/design.md, decision 19): a policy gradient on the rollout tokens, weighted by
each token's advantage, plus (``reward.sft_weight``) the rollout-matching SFT objective of the same rollouts.

``policy_gradient = -sum_t A_t * log p(y_t | y_<t) / N``, the sum over every policy-gradient token of the
micro-step and ``N`` the number of those tokens (token-mean normalisation: a long rollout weighs more than a short
one, and every token, zero-advantage ones included, counts in ``N``). ``log p`` is the full-vocabulary log-softmax
at temperature 1 of the same sanitised logits ``token_ce`` reads, so the gradient on a logit row is
``-A_t / N * (onehot(y_t) - softmax)``; a coordinate token is just a token here (its 999 neighbours are other
classes), which is why the coordinate-distribution losses stay on the SFT side.

``reward.kl_weight > 0`` adds ``kl_weight * sum_t k3_t / N`` with ``k3_t = exp(d_t) - d_t - 1``, ``d_t = log
p_ref(y_t) - log p(y_t)`` (Schulman's k3: non-negative, unbiased for KL(p || p_ref) on tokens sampled from ``p``),
``p_ref`` the frozen starting checkpoint's probability, read without gradients.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from coordexp.runtime.model.coord_losses import gathered_row_stats
from coordexp.runtime.model.losses import LossDenominators, ObjectiveResult, SupervisionBatch, compute_objective
from coordexp.schema.pipeline import PipelineConfig
from coordexp.schema.rollout import RepeatUnlikelihoodConfig

__all__ = ["policy_gradient_loss", "reward_objective", "reference_log_probs", "frozen_reference", "ENTROPY_SUMS"]

# rows of the logits whose entropy is computed at once (a figure, no gradient)
_ENTROPY_CHUNK = 256
# the policy's entropy at the trained tokens split by type, as sums (nats) and counts: the trainer adds them over a
# logging window and its ranks, so the logged token means (reward/entropy_coord, reward/entropy_text) are exact
ENTROPY_SUMS = ("entropy_sum/coord", "entropy_sum/coord_tokens", "entropy_sum/text", "entropy_sum/text_tokens")


def frozen_reference(model: Any) -> Any:
    """A frozen copy of ``model`` as it is now (the starting checkpoint, before any step): evaluation mode, no
    gradients, never optimized nor saved."""
    reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    return reference


@torch.no_grad()
def reference_log_probs(logits: torch.Tensor, batch: SupervisionBatch, coord_ids: torch.Tensor) -> torch.Tensor:
    """``log p_ref`` of each policy-gradient token of ``batch`` from the reference's logits (same layout)."""
    index = batch.pg_logit_index.to(logits.device)
    stats = gathered_row_stats(logits, index, coord_ids, [1.0], labels=batch.pg_labels)
    return stats.label_logit - stats.lse[1.0]


def policy_gradient_loss(logits: torch.Tensor, batch: SupervisionBatch, coord_ids: torch.Tensor,
                         tokens: float | None = None, *, compute_dtype: torch.dtype = torch.float32,
                         reference_log_p: torch.Tensor | None = None, kl_weight: float = 0.0
                         ) -> tuple[torch.Tensor, dict[str, float]]:
    """``-sum(A * log p) / tokens`` over ``batch``'s policy-gradient tokens (``tokens``: the micro-step's count,
    per rank under DDP or ZeRO, :attr:`LossDenominators.policy_normaliser`; default this batch's own), plus
    ``kl_weight * sum(k3) / tokens`` with ``reference_log_p`` (module doc), and its figures: the token-mean
    advantage, log-probability, entropy (nats) and k3 of the trained tokens, and the entropy's sums per token type
    (:data:`ENTROPY_SUMS`: a coordinate token is one whose id is in ``coord_ids``). Exactly 0, still
    backpropagating, when the batch has none."""
    index = batch.pg_logit_index.to(logits.device)
    count = int(index.numel())
    if count == 0:
        return logits.sum() * 0.0, {}
    stats = gathered_row_stats(logits, index, coord_ids, [1.0], labels=batch.pg_labels, compute_dtype=compute_dtype)
    log_p = stats.label_logit - stats.lse[1.0]
    advantages = batch.pg_advantages.to(device=logits.device, dtype=log_p.dtype)
    denominator = float(tokens) if tokens else count
    loss = -(advantages * log_p).sum() / denominator
    entropies = _token_entropies(logits, index)
    is_coord = torch.isin(batch.pg_labels.to(coord_ids.device), coord_ids).cpu()
    figures = {"policy_gradient/advantage_mean": float(advantages.mean()),
               "policy_gradient/logp_mean": float(log_p.detach().mean()),
               "policy_gradient/entropy": float(entropies.mean()),
               ENTROPY_SUMS[0]: float(entropies[is_coord].sum()), ENTROPY_SUMS[1]: float(is_coord.sum()),
               ENTROPY_SUMS[2]: float(entropies[~is_coord].sum()), ENTROPY_SUMS[3]: float((~is_coord).sum())}
    if reference_log_p is not None:
        gap = reference_log_p.to(device=log_p.device, dtype=log_p.dtype) - log_p
        k3 = torch.exp(gap) - gap - 1.0
        figures["kl"] = float(k3.detach().mean())
        if kl_weight > 0:
            loss = loss + kl_weight * k3.sum() / denominator
    return loss.to(torch.float32), figures


@torch.no_grad()
def _token_entropies(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary entropy (nats, float32, on the CPU) of the policy at each trained token, a chunk of rows at a
    time."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    chunks = []
    for start in range(0, int(index.numel()), _ENTROPY_CHUNK):
        rows = flat.index_select(0, index[start:start + _ENTROPY_CHUNK]).float()
        log_p = torch.log_softmax(torch.nan_to_num(rows, nan=0.0, posinf=1e4, neginf=-1e4), dim=-1)
        chunks.append(-(log_p.exp() * log_p).sum(dim=-1).cpu())
    return torch.cat(chunks) if chunks else torch.zeros(0)


def reward_objective(logits: torch.Tensor, batch: SupervisionBatch, coord_ids: torch.Tensor,
                     pipeline: PipelineConfig, denominators: LossDenominators | None, sft_weight: float,
                     repeat_ul: RepeatUnlikelihoodConfig | None = None, *,
                     reference_log_p: torch.Tensor | None = None, kl_weight: float = 0.0) -> ObjectiveResult:
    """``policy_gradient + sft_weight * rollout-matching SFT`` of one forward row; ``denominators`` are the
    micro-step's, so the rows of a packed step add up to the step's loss (decision 8), and its policy tokens those
    of every rank (the trainer's), so the ranks' averaged gradients are one process's. The SFT part runs only
    with ``sft_weight > 0`` (its segments are then in the batch); its terms are reported under their usual names.
    A step without any policy-gradient token (a ground-truth step, ``gt_step_share``; a validation loss) is plain
    SFT: ``compute_objective`` alone, at weight 1. ``reference_log_p`` (the frozen reference's log-probabilities of
    the policy tokens) with ``kl_weight > 0`` adds the KL term; ``policy_gradient`` is then reported with it, and
    ``kl`` (the token-mean k3) beside it. The entropy's sums per token type (:data:`ENTROPY_SUMS`) are in
    ``diagnostics``, for the trainer to add up."""
    whole = denominators if denominators is not None else LossDenominators.of(batch)
    if whole.policy_tokens == 0:
        return compute_objective(logits, batch, coord_ids, pipeline, denominators, repeat_ul)
    pg, figures = policy_gradient_loss(logits, batch, coord_ids, whole.policy_normaliser,
                                       reference_log_p=reference_log_p, kl_weight=kl_weight)
    total = pg
    # token means weighted by this row's share of the step's tokens: the rows' (and ranks') terms add up to the
    # step's means
    share = int(batch.pg_logit_index.numel()) / whole.policy_normaliser
    terms: dict[str, float] = {"policy_gradient": float(pg.detach())}
    terms.update({name: value * share for name, value in figures.items()
                  if name != "policy_gradient/advantage_mean" and name not in ENTROPY_SUMS})
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
