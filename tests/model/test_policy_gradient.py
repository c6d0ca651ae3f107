"""The reward objective's loss (issue 52): on a hand-built batch of two images with three rollouts each and known
rewards, the gradient on every logit equals the closed form ``-A_t / N * (onehot(y_t) - softmax(z_t))``; a group
of equal rewards moves nothing; rows of a packed step add up to the step, and ranks' averaged gradients to one
process's; the SFT part adds at its weight."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from coordexp.runtime.core.objects import TokenSupervision
from coordexp.runtime.core.reward import leave_one_out_advantages
from coordexp.runtime.model.losses import LossDenominators, SupervisionBatch, SupervisionSegment, compute_objective
from coordexp.runtime.model.policy_gradient import policy_gradient_loss, reward_objective

VOCAB = 1010
COORD_IDS = torch.arange(10, 1010)
SEQ_LEN = 16
# image A's rollouts earned 1, 0 and 0.5; image B's three rollouts earned the same 0.2
REWARDS = {"A": [1.0, 0.0, 0.5], "B": [0.2, 0.2, 0.2]}
# by hand: each reward minus the mean of the other two
EXPECTED_ADVANTAGES = {"A": [0.75, -0.75, 0.0], "B": [0.0, 0.0, 0.0]}
# (image, member, row, assistant start, assistant ids): two padded rows, three segments each
LAYOUT = [("A", 0, 0, 1, [11, 3, 7]), ("A", 1, 0, 5, [2, 2, 9, 4]), ("A", 2, 0, 11, [5, 1]),
          ("B", 0, 1, 1, [8, 6]), ("B", 1, 1, 4, [3, 3, 3]), ("B", 2, 1, 9, [1000, 4, 5, 6])]


def _pg_supervision(n_tokens: int, advantage: float) -> TokenSupervision:
    empty = np.zeros(0, np.int64)
    return TokenSupervision(empty, np.zeros(0, np.float32), empty, np.zeros(0, np.float32), np.zeros((0, 4), np.int64),
                            pg_positions=np.arange(n_tokens), pg_advantages=np.full(n_tokens, advantage, np.float32))


def _segments(advantages: dict[str, np.ndarray], layout=LAYOUT) -> list[SupervisionSegment]:
    return [SupervisionSegment(_pg_supervision(len(ids), float(advantages[image][member])), ids, row, start)
            for image, member, row, start, ids in layout]


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, SEQ_LEN, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def _closed_form_gradient(logits: torch.Tensor, advantages: dict[str, list[float]]) -> torch.Tensor:
    """``d/dz_t [-sum_t A_t log softmax(z_t)[y_t] / N] = -A_t / N * (onehot(y_t) - softmax(z_t))`` at the logit row
    predicting each token (position p is predicted at p - 1), zero elsewhere."""
    n = sum(len(ids) for *_, ids in LAYOUT)
    grad = torch.zeros_like(logits)
    for image, member, row, start, ids in LAYOUT:
        for k, token in enumerate(ids):
            z = logits[row, start + k - 1]
            onehot = torch.zeros(VOCAB, dtype=logits.dtype)
            onehot[token] = 1.0
            grad[row, start + k - 1] += -advantages[image][member] / n * (onehot - torch.softmax(z, dim=-1))
    return grad


def _production_advantages() -> dict[str, np.ndarray]:
    return {image: leave_one_out_advantages(rewards) for image, rewards in REWARDS.items()}


def test_the_gradient_on_two_images_of_three_rollouts_is_the_closed_form():
    advantages = _production_advantages()
    for image, expected in EXPECTED_ADVANTAGES.items():
        assert advantages[image].tolist() == pytest.approx(expected)
    logits = _logits().requires_grad_(True)
    batch = SupervisionBatch.from_segments(_segments(advantages), SEQ_LEN)
    loss, _ = policy_gradient_loss(logits, batch, COORD_IDS, compute_dtype=torch.float64)
    loss.backward()
    expected = _closed_form_gradient(logits.detach(), EXPECTED_ADVANTAGES)
    torch.testing.assert_close(logits.grad, expected, rtol=1e-6, atol=1e-9)
    assert float(expected.abs().sum()) > 0.1  # the check has something to compare
    # the value: -sum(A log p) / N over the 18 tokens
    log_p = torch.log_softmax(logits.detach(), dim=-1)
    value = -sum(EXPECTED_ADVANTAGES[image][member] * float(log_p[row, start + k - 1, token])
                 for image, member, row, start, ids in LAYOUT for k, token in enumerate(ids)) / 18
    assert float(loss.detach()) == pytest.approx(value, rel=1e-6)  # the loss is reported in float32


def test_the_k3_term_adds_its_closed_form_and_vanishes_at_the_reference():
    """``kl_weight * sum(exp(d) - d - 1) / N`` with ``d = log p_ref - log p``: its gradient on a logit row is
    ``kl_weight / N * (1 - exp(d)) * (onehot(y) - softmax(z))``; at ``p_ref = p`` the loss is the policy gradient's."""
    advantages = _production_advantages()
    batch = SupervisionBatch.from_segments(_segments(advantages), SEQ_LEN)
    reference = _logits(7)
    ref_log_p = torch.log_softmax(reference, dim=-1)
    logits = _logits(8).requires_grad_(True)
    loss, figures = policy_gradient_loss(logits, batch, COORD_IDS, compute_dtype=torch.float64, kl_weight=0.3,
                                         reference_log_p=ref_log_p.reshape(-1, VOCAB)[batch.pg_logit_index,
                                                                                       batch.pg_labels])
    loss.backward()
    log_p = torch.log_softmax(logits.detach(), dim=-1)
    expected = _closed_form_gradient(logits.detach(), EXPECTED_ADVANTAGES)
    for image, member, row, start, ids in LAYOUT:
        for k, token in enumerate(ids):
            gap = ref_log_p[row, start + k - 1, token] - log_p[row, start + k - 1, token]
            onehot = torch.zeros(VOCAB, dtype=torch.float64)
            onehot[token] = 1.0
            z = logits.detach()[row, start + k - 1]
            expected[row, start + k - 1] += 0.3 / 18 * (1 - torch.exp(gap)) * (onehot - torch.softmax(z, dim=-1))
    torch.testing.assert_close(logits.grad, expected, rtol=1e-6, atol=1e-9)
    assert figures["kl"] > 0
    same = _logits(9)
    at_reference = torch.log_softmax(same, dim=-1).reshape(-1, VOCAB)[batch.pg_logit_index, batch.pg_labels]
    with_kl, figures = policy_gradient_loss(same, batch, COORD_IDS, reference_log_p=at_reference, kl_weight=0.3)
    without, _ = policy_gradient_loss(same, batch, COORD_IDS)
    assert abs(figures["kl"]) < 1e-6 and float(with_kl) == pytest.approx(float(without), abs=1e-6)


def test_a_group_of_equal_rewards_adds_no_update():
    advantages = _production_advantages()
    logits = _logits(1).requires_grad_(True)
    policy_gradient_loss(logits, SupervisionBatch.from_segments(_segments(advantages), SEQ_LEN), COORD_IDS,
                         compute_dtype=torch.float64)[0].backward()
    assert torch.count_nonzero(logits.grad[1]) == 0  # image B's row: its three rollouts earned the same
    alone = _logits(1).requires_grad_(True)
    only_a = [entry for entry in LAYOUT if entry[0] == "A"]
    policy_gradient_loss(alone, SupervisionBatch.from_segments(_segments(advantages, only_a), SEQ_LEN), COORD_IDS,
                         tokens=18, compute_dtype=torch.float64)[0].backward()
    torch.testing.assert_close(logits.grad, alone.grad, rtol=0, atol=0)


def test_rows_of_one_step_add_up_to_the_step_and_kept_positions_change_nothing():
    advantages = _production_advantages()
    whole_batch = SupervisionBatch.from_segments(_segments(advantages), SEQ_LEN)
    logits = _logits(2).requires_grad_(True)
    whole = policy_gradient_loss(logits, whole_batch, COORD_IDS, compute_dtype=torch.float64)[0]
    whole.backward()
    rows = [SupervisionBatch.from_segments(_segments(advantages, [e for e in LAYOUT if e[0] == image]), SEQ_LEN)
            for image in "AB"]
    step = LossDenominators.of(rows[0]) + LossDenominators.of(rows[1])
    split = _logits(2).requires_grad_(True)
    total = sum(policy_gradient_loss(split, row, COORD_IDS, step.policy_tokens, compute_dtype=torch.float64)[0]
                for row in rows)
    total.backward()
    assert float(total.detach()) == pytest.approx(float(whole.detach()), rel=1e-6)
    torch.testing.assert_close(split.grad, logits.grad)
    positions, kept = whole_batch.at_kept_positions()
    kept_loss = policy_gradient_loss(_logits(2)[:, positions], kept, COORD_IDS, compute_dtype=torch.float64)[0]
    assert float(kept_loss) == pytest.approx(float(whole.detach()), rel=1e-6)


def test_the_reward_objective_adds_the_sft_target_at_its_weight_and_is_sft_without_policy_tokens(stage2_config):
    from coordexp.schema.pipeline import PipelineConfig

    pipeline = PipelineConfig.model_validate(stage2_config["rollout_matching"]["pipeline"])
    sft = TokenSupervision(np.array([0, 1]), np.ones(2, np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32),
                           np.zeros((0, 4), np.int64))
    advantages = _production_advantages()
    segments = _segments(advantages)[:3] + [SupervisionSegment(sft, [7, 8], 1, 2)]
    batch = SupervisionBatch.from_segments(segments, SEQ_LEN)
    logits = _logits(3)
    pg, _ = policy_gradient_loss(logits, batch, COORD_IDS)
    sft_total = compute_objective(logits, batch, COORD_IDS, pipeline).total
    result = reward_objective(logits, batch, COORD_IDS, pipeline, None, 0.5)
    assert float(result.total) == pytest.approx(float(pg) + 0.5 * float(sft_total), rel=1e-6)
    assert result.terms["sft"] == pytest.approx(float(sft_total), rel=1e-6)
    assert float(reward_objective(logits, batch, COORD_IDS, pipeline, None, 0.0).total) == pytest.approx(float(pg))
    gt_only = SupervisionBatch.from_segments([SupervisionSegment(sft, [7, 8], 1, 2)], SEQ_LEN)
    plain = reward_objective(logits, gt_only, COORD_IDS, pipeline, None, 0.0)  # a ground-truth step
    assert float(plain.total) == pytest.approx(float(compute_objective(logits, gt_only, COORD_IDS, pipeline).total))


def test_policy_tokens_are_checked_like_every_other_supervision():
    bad = _pg_supervision(3, 0.5)
    with pytest.raises(ValueError, match="pg_positions"):
        SupervisionBatch.from_segments([SupervisionSegment(bad, [1, 2], 0, 1)], SEQ_LEN)  # 3 positions, 2 ids
    nan = replace(_pg_supervision(2, 0.0), pg_advantages=np.array([0.0, np.nan], np.float32))
    with pytest.raises(ValueError, match="pg_advantages must be finite"):
        SupervisionBatch.from_segments([SupervisionSegment(nan, [1, 2], 0, 1)], SEQ_LEN)


def test_ranks_dividing_by_the_tokens_of_all_ranks_average_to_one_process(stage2_config):
    """DDP and ZeRO average the ranks' gradients: with the step's policy tokens over all ranks (the trainer's
    reduction), two ranks holding 11 and 7 of the 18 tokens average to the one-process loss and gradient; each
    rank's own count would not (decision 19)."""
    from coordexp.schema.pipeline import PipelineConfig

    pipeline = PipelineConfig.model_validate(stage2_config["rollout_matching"]["pipeline"])
    advantages = _production_advantages()
    whole_batch = SupervisionBatch.from_segments(_segments(advantages), SEQ_LEN)
    logits = _logits(4).requires_grad_(True)
    whole = reward_objective(logits, whole_batch, COORD_IDS, pipeline, None, 0.0)
    whole.total.backward()
    ranks = [SupervisionBatch.from_segments(_segments(advantages, part), SEQ_LEN) for part in (LAYOUT[:4], LAYOUT[4:])]
    own = [LossDenominators.of(rank) for rank in ranks]
    assert [d.policy_tokens for d in own] == [11, 7]
    every = replace(own[0] + own[1], ranks=2)

    def averaged(denominators: list[LossDenominators]) -> tuple[float, torch.Tensor, dict[str, float]]:
        split = _logits(4).requires_grad_(True)
        results = [reward_objective(split, rank, COORD_IDS, pipeline, d, 0.0) for rank, d in zip(ranks, denominators)]
        mean = sum(r.total for r in results) / 2
        mean.backward()  # the ranks' gradients, averaged
        terms = {k: sum(r.terms[k] for r in results) / 2 for k in whole.terms}  # the logged mean over ranks
        return float(mean.detach()), split.grad, terms

    loss, grad, terms = averaged([every, every])
    assert loss == pytest.approx(float(whole.total.detach()), rel=1e-6)
    torch.testing.assert_close(grad, logits.grad)
    assert terms == pytest.approx(whole.terms, rel=1e-6)
    local_loss, local_grad, _ = averaged(own)
    assert local_loss != pytest.approx(float(whole.total.detach()), rel=1e-3)
    assert not torch.allclose(local_grad, logits.grad)


def test_entropy_is_split_by_token_type_as_sums_the_trainer_adds_up(stage2_config):
    """Issue 52's figure 'entropy of the coordinate and text tokens': per trained token the full-vocabulary entropy
    of the policy, summed by whether the token's id is a coordinate id; the sums (not row means) leave the objective
    in ``diagnostics``, so two rows of a step add up to the step's exact token means."""
    from coordexp.runtime.model.policy_gradient import ENTROPY_SUMS

    logits = _logits(3)
    batch = SupervisionBatch.from_segments(_segments(_production_advantages()), SEQ_LEN)
    _, figures = policy_gradient_loss(logits, batch, COORD_IDS, compute_dtype=torch.float64)
    by_type = {True: [], False: []}
    for _, _, row, start, ids in LAYOUT:
        for k, token in enumerate(ids):
            p = torch.softmax(logits[row, start + k - 1], dim=-1)
            by_type[10 <= token < 1010].append(float(-(p * p.log()).sum()))
    assert len(by_type[True]) == 2 and len(by_type[False]) == 16  # ids 11 and 1000 are coordinates
    coord_sum, coord_n, text_sum, text_n = (figures[k] for k in ENTROPY_SUMS)
    assert (coord_n, text_n) == (2, 16)
    assert coord_sum == pytest.approx(sum(by_type[True]), rel=1e-5)
    assert text_sum == pytest.approx(sum(by_type[False]), rel=1e-5)
    assert figures["policy_gradient/entropy"] == pytest.approx((coord_sum + text_sum) / 18, rel=1e-5)
    from coordexp.schema.pipeline import PipelineConfig

    pipeline = PipelineConfig.model_validate(stage2_config["rollout_matching"]["pipeline"])
    result = reward_objective(logits, batch, COORD_IDS, pipeline, None, 0.0)
    assert not set(ENTROPY_SUMS) & set(result.terms)  # a sum is no loss term: terms are averaged over micro-steps
    assert [result.diagnostics[k] for k in ENTROPY_SUMS] == pytest.approx([coord_sum, coord_n, text_sum, text_n])


def test_the_frozen_reference_follows_the_policy_onto_its_device():
    """Under DeepSpeed the engine places the policy when training starts, after the trainer copied the model as
    loaded: the reference moves to the policy's device at its first use (the meta device stands in for a GPU)."""
    from coordexp.runtime.model.policy_gradient import frozen_reference
    from coordexp.runtime.train.trainer import CoordExpTrainer

    policy = torch.nn.Linear(3, 2)
    holder = type("Holder", (), {"_reference": frozen_reference(policy)})()
    reference = CoordExpTrainer._reference_on(holder, torch.device("meta"))
    assert next(reference.parameters()).device.type == "meta" and holder._reference is reference
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    assert next(policy.parameters()).device.type == "cpu"  # the policy itself is untouched
    assert CoordExpTrainer._reference_on(holder, torch.device("meta")) is reference  # moved once
