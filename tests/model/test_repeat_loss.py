"""The unlikelihood term of certified repeats (coordexp/runtime/model/repeat_loss.py; docs/design.md, decision 18):
hand-computed values, the spared band, packing and kept-position invariance, and that it pushes the repeat down."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from coordexp.runtime.model.losses import LossDenominators, SupervisionBatch, SupervisionSegment, compute_objective
from coordexp.runtime.model.repeat_loss import negative_band_mask, repeat_unlikelihood
from coordexp.runtime.core.objects import TokenSupervision
from coordexp.schema.rollout import RepeatUnlikelihoodConfig

from tests.model.test_losses import COORD_IDS, VOCAB, coord_id, make_pipeline

UL = RepeatUnlikelihoodConfig(weight=1.0, band=2)


def sup(ce=(), coord=(), targets=(), ul=()):
    """``ul``: (position, token, bin, exclude) per negative."""
    ul = list(ul)
    col = lambda k: np.asarray([u[k] for u in ul], np.int64)  # noqa: E731
    return TokenSupervision(
        ce_positions=np.asarray(ce, np.int64), ce_weights=np.ones(len(ce), np.float32),
        coord_positions=np.asarray(coord, np.int64), coord_targets=np.asarray(targets, np.float32),
        bbox_slots=np.zeros((0, 4), np.int64), ul_positions=col(0), ul_tokens=col(1), ul_bins=col(2),
        ul_exclude=col(3))


def test_band_mask_spares_the_targets_band():
    mask = negative_band_mask(torch.tensor([10, 10, 0]), torch.tensor([-1, 12, -1]), 2)
    assert torch.nonzero(mask[0]).flatten().tolist() == [8, 9, 10, 11, 12]
    assert torch.nonzero(mask[1]).flatten().tolist() == [8, 9]  # 10..12 lie within 2 of the target 12
    assert torch.nonzero(mask[2]).flatten().tolist() == [0, 1, 2]


def test_values_are_minus_log_one_minus_p():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    tokens = torch.tensor([3, coord_id(500)])
    term, mass = repeat_unlikelihood(logits, torch.tensor([1, 2]), tokens, torch.tensor([-1, 500]),
                                     torch.tensor([-1, 501]), COORD_IDS, 2)
    p = logits.softmax(-1)
    p_text = p[1, 3]
    p_band = p[2, coord_id(498)]  # 498..502 less 499..503 (within 2 of the target 501): bin 498 alone
    assert mass.item() == pytest.approx((p_text + p_band).item(), rel=1e-5)
    want = -math.log1p(-p_text.item()) - math.log1p(-p_band.item())
    assert term.item() == pytest.approx(want, rel=1e-5)


def test_a_band_wholly_spared_is_zero_with_a_finite_gradient():
    logits = torch.randn(2, VOCAB, requires_grad=True)
    term, _ = repeat_unlikelihood(logits, torch.tensor([0]), torch.tensor([coord_id(5)]), torch.tensor([5]),
                                  torch.tensor([5]), COORD_IDS, 0)
    term.backward()
    assert term.item() == pytest.approx(0.0, abs=1e-6) and torch.isfinite(logits.grad).all()


def test_descending_it_pushes_the_repeat_down_and_leaves_the_target_up():
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB)
    logits[0, coord_id(300)] += 6.0  # the model is sure of the repeat's bin
    logits[0, coord_id(320)] += 4.0  # and fairly sure of the target's
    logits.requires_grad_(True)
    opt = torch.optim.SGD([logits], lr=1.0)
    args = (torch.tensor([0]), torch.tensor([coord_id(300)]), torch.tensor([300]), torch.tensor([320]), COORD_IDS, 2)
    before = logits.softmax(-1)[0]
    for _ in range(20):
        opt.zero_grad()
        term, _ = repeat_unlikelihood(logits, *args)
        term.backward()
        opt.step()
    p = logits.softmax(-1)[0]
    assert p[coord_id(300)].item() < before[coord_id(300)].item() / 2
    assert p[coord_id(320)].item() > before[coord_id(320)].item()  # the spared target's band gained mass


def _batch(segments, seq_len):
    return SupervisionBatch.from_segments(segments, seq_len)


def test_objective_adds_the_weighted_mean_and_reports_count_and_mass():
    torch.manual_seed(2)
    logits = torch.randn(1, 8, VOCAB)
    ids = [5, coord_id(10), 6, coord_id(40), 7]
    s = sup(ce=[0, 2, 4], coord=[1, 3], targets=[10, 40], ul=[(2, 9, -1, -1), (3, coord_id(70), 70, 40)])
    batch = _batch([SupervisionSegment(s, ids, 0, 2)], 8)
    pipe = make_pipeline()
    plain = compute_objective(logits, batch, COORD_IDS, pipe)
    with_ul = compute_objective(logits, batch, COORD_IDS, pipe, repeat_ul=RepeatUnlikelihoodConfig(weight=0.5))
    term, mass = repeat_unlikelihood(logits.view(-1, VOCAB), torch.tensor([3, 4]), torch.tensor([9, coord_id(70)]),
                                     torch.tensor([-1, 70]), torch.tensor([-1, 40]), COORD_IDS, 2)
    assert with_ul.terms["repeat_ul"] == pytest.approx(term.item() / 2, rel=1e-5)
    assert with_ul.terms["repeat_ul/mass"] == pytest.approx(mass.item() / 2, rel=1e-5)
    assert with_ul.total.item() == pytest.approx(plain.total.item() + 0.5 * term.item() / 2, rel=1e-5)
    assert with_ul.counts["num_ul_negatives"] == 2 and "repeat_ul" not in plain.terms


def test_kept_positions_and_rows_split_give_the_same_term():
    torch.manual_seed(3)
    logits = torch.randn(2, 10, VOCAB)
    ids = [4, coord_id(1), 5, 6]
    a = SupervisionSegment(sup(ce=[0, 2, 3], coord=[1], targets=[1], ul=[(1, coord_id(9), 9, 1), (3, 8, -1, -1)]),
                           ids, 0, 3)
    b = SupervisionSegment(sup(ce=[0, 3], coord=[1], targets=[1], ul=[(2, 11, -1, -1)]), ids, 1, 5)
    pipe = make_pipeline()
    whole = compute_objective(logits, _batch([a, b], 10), COORD_IDS, pipe, repeat_ul=UL)
    keep, kept_batch = _batch([a, b], 10).at_kept_positions()
    kept = compute_objective(logits[:, keep], kept_batch, COORD_IDS, pipe, repeat_ul=UL)
    assert kept.terms["repeat_ul"] == pytest.approx(whole.terms["repeat_ul"], rel=1e-5)
    # one row at a time with the step's denominators adds up to the one-forward term (decision 8)
    row_a = SupervisionSegment(a.supervision, ids, 0, 3)
    row_b = SupervisionSegment(b.supervision, ids, 0, 5)
    batches = [_batch([row_a], 10), _batch([row_b], 10)]
    dens = LossDenominators.of(batches[0]) + LossDenominators.of(batches[1])
    parts = [compute_objective(logits[i:i + 1], bt, COORD_IDS, pipe, dens, repeat_ul=UL) for i, bt in
             enumerate(batches)]
    assert sum(p.terms["repeat_ul"] for p in parts) == pytest.approx(whole.terms["repeat_ul"], rel=1e-5)


@pytest.mark.parametrize("field, value, match", [
    ("ul_positions", [9], "outside the assistant span"),
    ("ul_bins", [1000], "coord bins"),
    ("ul_tokens", [1, 2], "one entry each"),
])
def test_malformed_negatives_are_refused(field, value, match):
    s = sup(ce=[0], ul=[(1, 3, -1, -1)])
    s = TokenSupervision(**{**s.__dict__, field: np.asarray(value, np.int64)})
    with pytest.raises(ValueError, match=match):
        _batch([SupervisionSegment(s, [1, 2, 3], 0, 1)], 6)
