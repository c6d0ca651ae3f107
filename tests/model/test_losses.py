"""Coord-distribution losses and the rollout-channel objective: hand-computed values, fences, gradients, packing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import coordexp.runtime.model.coord_losses as coord_losses_module
import coordexp.runtime.model.losses as losses_module
from coordexp.runtime.model.coord_losses import (
    GatheredRowStats,
    coord_columns,
    coord_gate_loss,
    coord_hard_ce,
    coord_log_probs,
    coord_vocab_log_mass,
    gather_fenced_rows,
    gathered_row_stats,
    gaussian_soft_targets,
    sanitize_logits,
    smoothl1_and_ciou,
    soft_ce,
    text_gate_loss,
    w1_distance,
)
from coordexp.runtime.model.losses import SupervisionBatch, SupervisionSegment, compute_objective
from coordexp.runtime.core.objects import TokenSupervision
from coordexp.schema.pipeline import PipelineConfig

NUM_TEXT = 30
VOCAB = NUM_TEXT + 1000
COORD_IDS = torch.arange(NUM_TEXT, NUM_TEXT + 1000, dtype=torch.long)  # text ids 0..29, coord bin k -> id 30 + k
LN1000 = math.log(1000.0)


def coord_id(bin_: int) -> int:
    return NUM_TEXT + bin_


def make_pipeline(
    token_ce: dict | None = None,
    coord_reg: dict | None = None,
    bbox_geo: dict | None = None,
    coord_diag: dict | None = None,
) -> PipelineConfig:
    """A pipeline with every module enabled on channel B and weight 1 unless overridden per module."""
    base = {"enabled": True, "weight": 1.0, "channels": ["B"]}
    reg_cfg = {
        "coord_ce_weight": 0.0,
        "soft_ce_weight": 1.0,
        "w1_weight": 1.0,
        "coord_gate_weight": 1.0,
        "text_gate_weight": 0.0,
        "temperature": 1.0,
        "target_sigma": 2.0,
        "target_truncate": None,
    }
    objective = [
        {
            **base,
            "name": "token_ce",
            "config": {"rollout_fn_desc_weight": 0.0, "rollout_matched_prefix_struct_weight": 0.0},
        },
        {**base, "name": "coord_reg", "config": reg_cfg},
        {**base, "name": "bbox_geo", "config": {"smoothl1_weight": 1.0, "ciou_weight": 1.0}},
    ]
    overrides = {"token_ce": token_ce or {}, "coord_reg": coord_reg or {}, "bbox_geo": bbox_geo or {}}
    for module in objective:
        extra = dict(overrides[module["name"]])
        module["config"] = {**module["config"], **extra.pop("config", {})}
        module.update(extra)
    diagnostics = [{**base, "name": "coord_diag", "config": {}, **(coord_diag or {})}]
    return PipelineConfig.model_validate({"objective": objective, "diagnostics": diagnostics})


def supervision(ce_pos=(), ce_w=None, coord_pos=(), targets=(), slots=None) -> TokenSupervision:
    ce_pos = np.asarray(ce_pos, dtype=np.int64)
    return TokenSupervision(
        ce_positions=ce_pos,
        ce_weights=np.ones(len(ce_pos), np.float32) if ce_w is None else np.asarray(ce_w, np.float32),
        coord_positions=np.asarray(coord_pos, dtype=np.int64),
        coord_targets=np.asarray(targets, dtype=np.float32),
        bbox_slots=np.zeros((0, 4), np.int64) if slots is None else np.asarray(slots, np.int64),
    )


# ------------------------------------------------------------------ numeric fences and the shared gate helper


def test_sanitize_replaces_nan_and_clamps_infinities_in_float32():
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 2e4, -3.5], dtype=torch.bfloat16)
    out = sanitize_logits(x)
    assert out.dtype == torch.float32
    assert out.tolist() == [0.0, 1e4, -1e4, 1e4, -3.5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gather_fence_matches_gather_then_sanitize_in_value_and_gradient(dtype):
    torch.manual_seed(2)
    base = torch.randn(6, 40) * 5
    base[1, 3], base[2, 7], base[4, 0], base[4, 1] = float("nan"), float("inf"), float("-inf"), 3e4
    index = torch.tensor([4, 1, 1, 2, 5])  # repeated row: its gradient accumulates
    upstream = torch.randn(5, 40)
    results = []
    for fused in (True, False):
        flat = base.clone().to(dtype).requires_grad_(True)
        out = gather_fenced_rows(flat, index) if fused else sanitize_logits(flat.index_select(0, index))
        (out * upstream).sum().backward()
        results.append((out.detach(), flat.grad))
    (fused_out, fused_grad), (ref_out, ref_grad) = results
    assert fused_out.dtype == torch.float32 and torch.equal(fused_out, ref_out)
    assert fused_grad.dtype == dtype and torch.allclose(fused_grad.float(), ref_grad.float())
    assert fused_grad[1, 3] == 0 and fused_grad[2, 7] == 0 and fused_grad[4, 1] == 0
    assert fused_grad[1, 0].float() == pytest.approx((upstream[1, 0] + upstream[2, 0]).item(), rel=1e-2)


def test_coord_columns_handles_consecutive_and_scattered_ids():
    rows = torch.randn(3, VOCAB)
    assert torch.equal(coord_columns(rows, COORD_IDS), rows[:, COORD_IDS])
    scattered = torch.randperm(VOCAB)[:1000]
    assert torch.equal(coord_columns(rows, scattered), rows[:, scattered])


def test_gate_is_zero_when_all_mass_is_on_coord_ids():
    rows = torch.zeros(3, VOCAB)
    rows[:, :NUM_TEXT] = float("-inf")
    rows[1, :NUM_TEXT] = -1e4
    assert torch.allclose(coord_gate_loss(rows, COORD_IDS, 1.0), torch.zeros(3), atol=1e-6)


def test_gate_is_ln2_when_half_the_mass_leaks_and_honours_temperature():
    rows = torch.full((1, VOCAB), -1e4)
    rows[0, COORD_IDS] = 0.0  # coord mass 1000 * e^0
    rows[0, 5] = LN1000  # one text token with the same mass
    assert coord_gate_loss(rows, COORD_IDS, 1.0).item() == pytest.approx(math.log(2.0), abs=1e-5)
    # scaling logits by T and dividing by T gives the same distribution
    assert coord_gate_loss(rows * 3.0, COORD_IDS, 3.0).item() == pytest.approx(math.log(2.0), abs=1e-5)
    # at T=2 the text token has e^(ln1000/2) = sqrt(1000) vs 1000 coord mass
    expected = math.log((1000.0 + math.sqrt(1000.0)) / 1000.0)
    assert coord_gate_loss(rows, COORD_IDS, 2.0).item() == pytest.approx(expected, abs=1e-5)


def test_text_gate_is_fp_neutral_and_nonzero_under_coord_mass():
    no_coord = torch.full((1, VOCAB), -1e4)
    no_coord[0, 3] = 5.0
    assert text_gate_loss(no_coord, COORD_IDS, 1.0).item() == pytest.approx(0.0, abs=1e-6)
    half = torch.full((1, VOCAB), -1e4)
    half[0, COORD_IDS] = 0.0
    half[0, 3] = LN1000
    assert text_gate_loss(half, COORD_IDS, 1.0).item() == pytest.approx(math.log(2.0), abs=1e-5)
    all_coord = torch.zeros(1, VOCAB, requires_grad=True)
    with torch.no_grad():
        all_coord[0, :NUM_TEXT] = float("-inf")
    value = text_gate_loss(all_coord, COORD_IDS, 1.0)
    assert value.item() == pytest.approx(-math.log(1e-6), rel=1e-3)  # capped, finite
    value.sum().backward()
    assert torch.isfinite(all_coord.grad).all()


def test_text_gate_gradient_pushes_coord_logits_down():
    rows = torch.zeros(2, VOCAB, requires_grad=True)
    text_gate_loss(rows, COORD_IDS, 1.0).sum().backward()
    assert (rows.grad[:, COORD_IDS] > 0).all() and (rows.grad[:, :NUM_TEXT] < 0).all()


def test_gate_helper_rejects_bad_temperature_and_coord_ids():
    rows = torch.zeros(1, VOCAB)
    with pytest.raises(ValueError, match="temperature"):
        coord_vocab_log_mass(rows, COORD_IDS, 0.0)
    with pytest.raises(ValueError, match="1000 ids"):
        coord_vocab_log_mass(rows, COORD_IDS[:10], 1.0)
    with pytest.raises(ValueError, match="lacks the coord tokens"):
        coord_vocab_log_mass(torch.zeros(1, 500), COORD_IDS, 1.0)


# ------------------------------------------------------------------ soft targets, softCE, W1, hard CE


def test_gaussian_targets_match_hand_values():
    q = gaussian_soft_targets(torch.tensor([500.0, 0.0]), sigma=2.0, truncate=None)
    assert q.sum(dim=1).tolist() == pytest.approx([1.0, 1.0], abs=1e-6)
    assert q[0, 500].item() == pytest.approx(1.0 / (2.0 * math.sqrt(2.0 * math.pi)), abs=1e-5)  # 0.19947
    assert q[1, 0].item() == pytest.approx(0.3326, abs=1e-4)  # half the Gaussian is cut at the edge
    one_hot = gaussian_soft_targets(torch.tensor([7.0]), sigma=2.0, truncate=0.0)
    assert one_hot[0, 7].item() == 1.0 and one_hot.sum().item() == 1.0
    five = gaussian_soft_targets(torch.tensor([500.0]), sigma=2.0, truncate=2.0)[0]
    assert torch.count_nonzero(five).item() == 5
    assert five[498:503].tolist() == pytest.approx([0.1525, 0.2218, 0.2514, 0.2218, 0.1525], abs=1e-4)


def test_gaussian_targets_validate_and_clamp_centres():
    with pytest.raises(ValueError, match="target_sigma"):
        gaussian_soft_targets(torch.tensor([1.0]), sigma=0.0, truncate=None)
    with pytest.raises(ValueError, match="target_truncate"):
        gaussian_soft_targets(torch.tensor([1.0]), sigma=1.0, truncate=-1.0)
    q = gaussian_soft_targets(torch.tensor([1500.0]), sigma=1.0, truncate=0.0)
    assert q[0, 999].item() == 1.0
    tiny = gaussian_soft_targets(torch.tensor([3.5]), sigma=1e-3, truncate=0.2)  # nearest bins kept, no NaN
    assert torch.isfinite(tiny).all() and tiny.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("truncate", [None, 0.0, 3.0])
def test_soft_ce_of_uniform_prediction_is_ln_1000(truncate):
    log_p = coord_log_probs(torch.zeros(2, 1000), 1.0)
    q = gaussian_soft_targets(torch.tensor([0.0, 512.3]), sigma=2.0, truncate=truncate)
    assert soft_ce(log_p, q).tolist() == pytest.approx([LN1000, LN1000], abs=1e-5)


def test_w1_of_two_bin_one_hot_shift_is_2_over_999():
    p = torch.zeros(1, 1000)
    q = torch.zeros(1, 1000)
    p[0, 10], q[0, 12] = 1.0, 1.0
    assert w1_distance(p, q).item() == pytest.approx(2.0 / 999.0, abs=1e-7)


def test_w1_uniform_against_sigma2_target_at_500():
    p = torch.full((1, 1000), 1e-3)
    q = gaussian_soft_targets(torch.tensor([500.0]), 2.0, None)
    assert w1_distance(p, q).item() == pytest.approx(0.2487, abs=1e-4)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 999), st.integers(0, 999))
def test_w1_between_one_hots_is_their_distance_over_999(a, b):
    p, q = torch.zeros(1, 1000), torch.zeros(1, 1000)
    p[0, a], q[0, b] = 1.0, 1.0
    assert w1_distance(p, q).item() == pytest.approx(abs(a - b) / 999.0, abs=1e-6)


def test_hard_coord_ce_targets_the_rounded_bin():
    logits = torch.zeros(1, 1000)
    logits[0, 4] = math.log(999.0)  # p(bin 4) = 999 / (999 + 999) = 1/2
    log_p = coord_log_probs(logits, 1.0)
    assert coord_hard_ce(log_p, torch.tensor([3.6])).item() == pytest.approx(math.log(2.0), abs=1e-5)
    assert coord_hard_ce(log_p, torch.tensor([3.4])).item() == pytest.approx(math.log(1998.0), abs=1e-4)


def test_smoothl1_and_ciou_hand_values():
    pred = torch.tensor([[0.0, 0.0, 0.5, 0.5]])
    gt = torch.tensor([[0.25, 0.25, 0.75, 0.75]])
    sl1, one_minus_ciou = smoothl1_and_ciou(pred, gt)
    assert sl1.item() == pytest.approx(0.5 * 0.25**2, abs=1e-7)
    # IoU = 0.0625 / 0.4375 = 1/7; centre distance^2 / enclosing diagonal^2 = 0.125 / 1.125 = 1/9; same aspect
    assert one_minus_ciou.item() == pytest.approx(1.0 - (1.0 / 7.0 - 1.0 / 9.0), abs=1e-5)
    same_sl1, same_ciou = smoothl1_and_ciou(gt, gt)
    assert same_sl1.item() == 0.0 and same_ciou.item() == pytest.approx(0.0, abs=1e-6)
    degenerate = torch.tensor([[0.2, 0.2, 0.2, 0.6]])
    assert all(torch.isfinite(t) for t in smoothl1_and_ciou(degenerate, degenerate))


# ------------------------------------------------------------------ SupervisionBatch


def test_from_segments_maps_labels_to_the_previous_logit_row():
    sup = supervision(ce_pos=[0, 3], coord_pos=[1, 2], targets=[10.0, 20.5])
    seg = SupervisionSegment(sup, [7, coord_id(10), coord_id(20), 8], row=1, assistant_start=5)
    batch = SupervisionBatch.from_segments([seg], seq_len=12)
    # label at absolute p of row r is predicted by flattened logit r*T + p - 1
    assert batch.ce_logit_index.tolist() == [12 + 5 - 1, 12 + 8 - 1]
    assert batch.ce_labels.tolist() == [7, 8]
    assert batch.coord_logit_index.tolist() == [12 + 6 - 1, 12 + 7 - 1]
    assert batch.coord_targets.tolist() == [10.0, 20.5]
    assert batch.num_rows == 2


def test_from_segments_offsets_bbox_slots_into_the_batch():
    first = SupervisionSegment(supervision(coord_pos=[0, 1], targets=[1, 2]), [coord_id(1), coord_id(2)], 0, 1)
    box = supervision(coord_pos=[0, 1, 2, 3], targets=[1, 2, 3, 4], slots=[[0, 1, 2, 3]])
    second = SupervisionSegment(box, [coord_id(k) for k in (1, 2, 3, 4)], 0, 4)
    batch = SupervisionBatch.from_segments([first, second], seq_len=9)
    assert batch.bbox_slots.tolist() == [[2, 3, 4, 5]]


@pytest.mark.parametrize(
    "seg, match",
    [
        (SupervisionSegment(supervision(ce_pos=[0]), [1, 2], 0, 0), "absolute position 0"),
        (SupervisionSegment(supervision(ce_pos=[2]), [1, 2], 0, 1), "outside the assistant span"),
        (SupervisionSegment(supervision(coord_pos=[-1], targets=[3]), [1, 2], 0, 1), "outside the assistant span"),
        (SupervisionSegment(supervision(ce_pos=[0]), [1, 2], 0, 9), "does not fit a row"),
        (SupervisionSegment(supervision(ce_pos=[0], coord_pos=[0], targets=[1]), [1], 0, 1), "both ce_positions"),
        (
            SupervisionSegment(supervision(coord_pos=[0], targets=[1], slots=[[0, 0, 0, 1]]), [1, 2], 0, 1),
            "bbox_slots",
        ),
        (SupervisionSegment(supervision(coord_pos=[0], targets=[1000.5]), [1], 0, 1), r"\[0, 999\]"),
        (SupervisionSegment(supervision(ce_pos=[0], ce_w=[0.0]), [1], 0, 1), "ce_weights"),
        (SupervisionSegment(supervision(ce_pos=[0, 0]), [1], 0, 1), "repeats"),
    ],
)
def test_from_segments_rejects_bad_indices_with_clear_errors(seg, match):
    with pytest.raises(ValueError, match=match):
        SupervisionBatch.from_segments([seg], seq_len=10)


def test_from_segments_rejects_overlapping_segments_in_one_row():
    a = SupervisionSegment(supervision(ce_pos=[0]), [1, 2, 3], 0, 2)
    b = SupervisionSegment(supervision(ce_pos=[0]), [1, 2], 0, 4)
    with pytest.raises(ValueError, match="overlap in row 0"):
        SupervisionBatch.from_segments([a, b], seq_len=10)
    SupervisionBatch.from_segments([a, b._replace(row=1)], seq_len=10)  # other row: fine


# ------------------------------------------------------------------ compute_objective


def _random_segment(rng: np.random.Generator, n_assistant: int, n_boxes: int):
    """Assistant ids = text tokens with ``4 * n_boxes`` coord tokens, every token supervised."""
    ids = rng.integers(0, NUM_TEXT, size=n_assistant)
    coord_pos = np.sort(rng.choice(n_assistant, size=4 * n_boxes, replace=False))
    bins = rng.integers(0, 1000, size=coord_pos.size)
    ids[coord_pos] = NUM_TEXT + bins
    ce_pos = np.setdiff1d(np.arange(n_assistant), coord_pos)
    sup = TokenSupervision(
        ce_positions=ce_pos,
        ce_weights=rng.uniform(0.5, 2.0, size=ce_pos.size).astype(np.float32),
        coord_positions=coord_pos,
        coord_targets=(bins + rng.uniform(-0.4, 0.4, size=bins.size)).clip(0, 999).astype(np.float32),
        bbox_slots=np.arange(4 * n_boxes).reshape(n_boxes, 4),
    )
    return sup, ids.tolist()


def test_token_ce_is_the_weighted_mean_of_full_vocab_ce():
    torch.manual_seed(0)
    sup = supervision(ce_pos=[0, 1, 2], ce_w=[1.0, 2.0, 0.5])
    ids = [3, 4, 5]
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, ids, 0, 2)], seq_len=6)
    logits = torch.randn(1, 6, VOCAB)
    result = compute_objective(logits, batch, COORD_IDS, make_pipeline())
    ce = torch.nn.functional.cross_entropy(logits[0, 1:4], torch.tensor(ids), reduction="none")
    expected = (ce * torch.tensor([1.0, 2.0, 0.5])).sum() / 3.5
    assert result.terms["token_ce"] == pytest.approx(expected.item(), abs=1e-5)
    assert result.counts == {"num_ce_tokens": 3, "num_coord_tokens": 0, "num_bbox_slots": 0}


def test_uniform_logits_give_hand_computed_coord_terms():
    sup = supervision(coord_pos=[0, 1], targets=[100.0, 900.0])
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, [coord_id(100), coord_id(900)], 0, 1)], 4)
    logits = torch.full((1, 4, VOCAB), -1e4)
    logits[..., COORD_IDS] = 0.0
    pipe = make_pipeline(coord_reg={"config": {"coord_ce_weight": 1.0}})
    terms = compute_objective(logits, batch, COORD_IDS, pipe).terms
    assert terms["coord_reg/soft_ce"] == pytest.approx(LN1000, abs=1e-4)
    assert terms["coord_reg/coord_ce"] == pytest.approx(LN1000, abs=1e-4)
    assert terms["coord_reg/gate"] == pytest.approx(0.0, abs=1e-6)
    # expected box of a uniform distribution is 499.5 / 999 = 0.5 per coordinate
    assert terms["coord_reg"] == pytest.approx(2 * LN1000 + terms["coord_reg/w1"], abs=1e-4)


def test_no_supervised_coord_or_text_gives_exact_zeros_not_nan():
    batch = SupervisionBatch.from_segments([SupervisionSegment(supervision(), [1, 2], 0, 1)], seq_len=4)
    logits = torch.randn(1, 4, VOCAB, requires_grad=True)
    pipe = make_pipeline(coord_reg={"config": {"coord_ce_weight": 1.0, "text_gate_weight": 1.0}})
    result = compute_objective(logits, batch, COORD_IDS, pipe)
    assert all(value == 0.0 for value in result.terms.values()), result.terms
    assert result.total.item() == 0.0
    result.total.backward()
    assert torch.count_nonzero(logits.grad) == 0


def test_nan_and_inf_logits_give_finite_loss_and_gradients():
    sup = supervision(ce_pos=[0], coord_pos=[1, 2, 3, 4], targets=[1, 2, 30, 40], slots=[[0, 1, 2, 3]])
    ids = [5, coord_id(1), coord_id(2), coord_id(30), coord_id(40)]
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, ids, 0, 1)], seq_len=6)
    raw = torch.randn(1, 6, VOCAB)
    raw[0, 0, :50] = float("nan")
    raw[0, 1, COORD_IDS[:300]] = float("inf")
    raw[0, 2, :] = float("-inf")
    raw[0, 3, 7] = float("inf")
    logits = raw.clone().requires_grad_(True)
    pipe = make_pipeline(coord_reg={"config": {"coord_ce_weight": 1.0, "text_gate_weight": 1.0}})
    result = compute_objective(logits, batch, COORD_IDS, pipe)
    assert math.isfinite(result.total.item())
    assert all(math.isfinite(v) for v in [*result.terms.values(), *result.diagnostics.values()])
    result.total.backward()
    assert torch.isfinite(logits.grad).all()


def test_coord_losses_pull_mass_towards_the_target_bin_and_onto_coord_ids():
    sup = supervision(coord_pos=[0], targets=[400.0])
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, [coord_id(400)], 0, 1)], seq_len=2)
    logits = torch.zeros(1, 2, VOCAB, requires_grad=True)
    compute_objective(logits, batch, COORD_IDS, make_pipeline()).total.backward()
    grad = logits.grad[0, 0]
    coord_grad = grad[COORD_IDS]
    assert coord_grad[400] < 0 and coord_grad.argmin().item() == 400  # descent raises the target bin most
    assert coord_grad[0] > 0 and coord_grad[999] > 0
    assert (grad[:NUM_TEXT] > 0).all()  # the gate pushes text mass down at a coord slot
    assert torch.count_nonzero(logits.grad[0, 1]) == 0  # the last row predicts nothing supervised


def test_bbox_geo_pulls_the_expected_box_towards_the_target():
    targets = [100.0, 100.0, 300.0, 300.0]
    sup = supervision(coord_pos=[0, 1, 2, 3], targets=targets, slots=[[0, 1, 2, 3]])
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, [coord_id(int(t)) for t in targets], 0, 1)], 5)
    logits = torch.zeros(1, 5, VOCAB, requires_grad=True)
    pipe = make_pipeline(token_ce={"enabled": False}, coord_reg={"enabled": False})
    result = compute_objective(logits, batch, COORD_IDS, pipe)
    assert set(result.terms) == {"bbox_geo", "bbox_geo/smoothl1", "bbox_geo/ciou"}
    # uniform prediction: expected box (0.5, 0.5, 0.5, 0.5) vs target / 999
    t = torch.tensor(targets) / 999.0
    assert result.terms["bbox_geo/smoothl1"] == pytest.approx((0.5 * (0.5 - t) ** 2).mean().item(), abs=1e-6)
    result.total.backward()
    # x1 expected 499.5 must move down towards 100: descent raises low bins, so low-bin gradient is negative
    row_grad = logits.grad[0, 0, COORD_IDS]
    assert row_grad[:100].mean() < 0 < row_grad[600:].mean()


def test_pipeline_respects_enabled_channels_and_weight():
    sup = supervision(ce_pos=[0], coord_pos=[1], targets=[5.0])
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, [3, coord_id(5)], 0, 1)], seq_len=4)
    torch.manual_seed(1)
    logits = torch.randn(1, 4, VOCAB)
    full = compute_objective(logits, batch, COORD_IDS, make_pipeline())
    t = full.terms
    assert full.total.item() == pytest.approx(t["token_ce"] + t["coord_reg"] + t["bbox_geo"], rel=1e-6)
    weighted = compute_objective(logits, batch, COORD_IDS, make_pipeline(coord_reg={"weight": 2.5}))
    assert weighted.total.item() == pytest.approx(t["token_ce"] + 2.5 * t["coord_reg"] + t["bbox_geo"], rel=1e-6)
    channel_a = compute_objective(logits, batch, COORD_IDS, make_pipeline(coord_reg={"channels": ["A"]}))
    assert "coord_reg" not in channel_a.terms
    assert channel_a.total.item() == pytest.approx(t["token_ce"] + t["bbox_geo"], rel=1e-6)
    disabled = compute_objective(logits, batch, COORD_IDS, make_pipeline(token_ce={"enabled": False}))
    assert "token_ce" not in disabled.terms
    no_diag = compute_objective(logits, batch, COORD_IDS, make_pipeline(coord_diag={"enabled": False}))
    assert no_diag.diagnostics == {} and set(full.diagnostics) >= {"coord_diag/coord_mass", "coord_diag/entropy"}


def test_zero_weight_coord_terms_are_not_computed_or_reported():
    sup = supervision(coord_pos=[0], targets=[5.0])
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, [coord_id(5)], 0, 1)], seq_len=2)
    pipe = make_pipeline(coord_reg={"config": {"w1_weight": 0.0, "coord_gate_weight": 0.0}})
    terms = compute_objective(torch.zeros(1, 2, VOCAB), batch, COORD_IDS, pipe).terms
    assert {k for k in terms if k.startswith("coord_reg/")} == {"coord_reg/soft_ce"}


def test_text_gate_term_is_nonzero_only_with_coord_mass_at_text_positions():
    sup = supervision(ce_pos=[0])
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, [3], 0, 1)], seq_len=2)
    pipe = make_pipeline(coord_reg={"config": {"text_gate_weight": 1.0}})
    clean = torch.full((1, 2, VOCAB), -1e4)
    clean[0, 0, 3] = 0.0
    assert compute_objective(clean, batch, COORD_IDS, pipe).terms["coord_reg/text_gate"] == pytest.approx(
        0.0, abs=1e-6
    )
    leaky = clean.clone()
    leaky[0, 0, COORD_IDS] = 0.0
    value = compute_objective(leaky, batch, COORD_IDS, pipe).terms["coord_reg/text_gate"]
    assert value == pytest.approx(math.log(1001.0), abs=1e-4)  # 1 - p_coord = 1/1001


def test_objective_gate_equals_the_shared_helper_on_the_same_rows():
    torch.manual_seed(3)
    sup = supervision(coord_pos=[0, 1], targets=[5.0, 6.0])
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, [coord_id(5), coord_id(6)], 0, 1)], seq_len=3)
    logits = torch.randn(1, 3, VOCAB) * 4
    pipe = make_pipeline(coord_reg={"config": {"temperature": 1.7}})
    gate = compute_objective(logits, batch, COORD_IDS, pipe).terms["coord_reg/gate"]
    assert gate == pytest.approx(coord_gate_loss(logits[0, :2], COORD_IDS, 1.7).mean().item(), abs=1e-6)


def test_coord_diag_reports_mass_entropy_and_expected_bin_error():
    sup = supervision(ce_pos=[0], coord_pos=[1], targets=[250.0])
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, [3, coord_id(250)], 0, 1)], seq_len=3)
    logits = torch.full((1, 3, VOCAB), -1e4)
    logits[0, 0, 3] = 0.0  # text position: all mass on the text label
    logits[0, 1, coord_id(260)] = 0.0  # coord position: all mass on bin 260
    diag = compute_objective(logits, batch, COORD_IDS, make_pipeline()).diagnostics
    assert diag["coord_diag/coord_mass"] == pytest.approx(1.0, abs=1e-6)
    assert diag["coord_diag/text_coord_mass"] == pytest.approx(0.0, abs=1e-6)
    assert diag["coord_diag/entropy"] == pytest.approx(0.0, abs=1e-4)
    assert diag["coord_diag/expected_bin_abs_err"] == pytest.approx(10.0, abs=1e-3)
    assert not any("iou" in key.lower() for key in diag)


def test_logits_must_match_the_batch_layout():
    batch = SupervisionBatch.from_segments([SupervisionSegment(supervision(ce_pos=[0]), [3], 1, 1)], seq_len=3)
    with pytest.raises(ValueError, match="does not match the supervision batch"):
        compute_objective(torch.zeros(1, 3, VOCAB), batch, COORD_IDS, make_pipeline())
    with pytest.raises(ValueError, match="does not match the supervision batch"):
        compute_objective(torch.zeros(2, 4, VOCAB), batch, COORD_IDS, make_pipeline())


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 3), prompt=st.integers(1, 6))
def test_loss_on_kept_logit_positions_equals_the_full_logits_loss(seed, rows, prompt):
    """Logits computed only where the losses read (union of supervised rows' positions) give the same terms and
    the same gradient there; every other logit (prompt, padding) gets exactly zero gradient from the full loss."""
    rng = np.random.default_rng(seed)
    segments, lengths = [], []
    for row in range(rows):
        n = int(rng.integers(2, 9))
        sup, ids = _random_segment(rng, n, int(rng.integers(0, n // 4 + 1)))
        segments.append(SupervisionSegment(sup, ids, row, prompt + int(rng.integers(0, 3))))
        lengths.append(segments[-1][3] + n)
    seq_len = max(lengths) + int(rng.integers(0, 3))
    batch = SupervisionBatch.from_segments(segments, seq_len)
    positions, kept_batch = batch.at_kept_positions()
    assert positions.tolist() == sorted(set((torch.cat([batch.ce_logit_index, batch.coord_logit_index]) % seq_len).tolist()))
    assert kept_batch.seq_len == positions.numel() < seq_len  # position 0 predicts no supervised label
    full = (torch.randn(rows, seq_len, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3).requires_grad_()
    kept = full.detach()[:, positions].clone().requires_grad_()
    expected = compute_objective(full, batch, COORD_IDS, make_pipeline())
    actual = compute_objective(kept, kept_batch, COORD_IDS, make_pipeline())
    assert actual.counts == expected.counts
    for name, value in expected.terms.items():
        assert actual.terms[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    expected.total.backward()
    actual.total.backward()
    torch.testing.assert_close(kept.grad, full.grad[:, positions], rtol=1e-5, atol=1e-7)
    others = torch.ones(seq_len, dtype=torch.bool)
    others[positions] = False
    assert float(full.grad[:, others].abs().max()) == 0.0


def test_kept_positions_of_an_unsupervised_batch_keep_one_position_and_a_zero_loss():
    batch = SupervisionBatch.from_segments([SupervisionSegment(supervision(), [1, 2], 0, 1)], seq_len=4)
    positions, kept_batch = batch.at_kept_positions()
    assert positions.tolist() == [0] and kept_batch.seq_len == 1
    logits = torch.randn(1, 1, VOCAB, requires_grad=True)
    result = compute_objective(logits, kept_batch, COORD_IDS, make_pipeline())
    assert float(result.total.detach()) == 0.0
    result.total.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


# ------------------------------------------------------------------ packed == unpacked (decision 8)


def _packed_vs_unpacked(seed: int, prompt_lens: list[int], assistant_lens: list[int], boxes: list[int]):
    rng = np.random.default_rng(seed)
    segs = [_random_segment(rng, n, k) for n, k in zip(assistant_lens, boxes, strict=True)]
    seg_lens = [p + n for p, n in zip(prompt_lens, assistant_lens, strict=True)]
    packed_len, pad_len = sum(seg_lens) + 1, max(seg_lens) + 2
    # The same per-segment logits placed packed (one row) and padded (one row each).
    seg_logits = [
        torch.randn(length, VOCAB, generator=torch.Generator().manual_seed(seed + i)) * 3
        for i, length in enumerate(seg_lens)
    ]
    packed = torch.randn(1, packed_len, VOCAB)
    padded = torch.randn(len(segs), pad_len, VOCAB)
    packed_segments, padded_segments, offset = [], [], 0
    for i, ((sup, ids), p_len, s_len) in enumerate(zip(segs, prompt_lens, seg_lens, strict=True)):
        packed[0, offset : offset + s_len] = seg_logits[i]
        padded[i, :s_len] = seg_logits[i]
        packed_segments.append(SupervisionSegment(sup, ids, 0, offset + p_len))
        padded_segments.append(SupervisionSegment(sup, ids, i, p_len))
        offset += s_len
    pipe = make_pipeline(coord_reg={"config": {"coord_ce_weight": 0.5, "text_gate_weight": 0.3}})
    results = []
    for logits, segments, seq_len in ((packed, packed_segments, packed_len), (padded, padded_segments, pad_len)):
        logits = logits.clone().requires_grad_(True)
        result = compute_objective(logits, SupervisionBatch.from_segments(segments, seq_len), COORD_IDS, pipe)
        result.total.backward()
        results.append((result, logits.grad))
    (packed_res, packed_grad), (padded_res, padded_grad) = results
    offset = 0
    for i, s_len in enumerate(seg_lens):
        assert torch.allclose(packed_grad[0, offset : offset + s_len], padded_grad[i, :s_len], atol=1e-6)
        offset += s_len
    assert (
        torch.count_nonzero(packed_grad[0, offset:]) == 0 and torch.count_nonzero(padded_grad[0, seg_lens[0] :]) == 0
    )
    return packed_res, padded_res


def test_packed_row_gives_the_same_loss_and_gradients_as_unpacked_rows():
    packed, padded = _packed_vs_unpacked(7, prompt_lens=[3, 5, 2], assistant_lens=[12, 20, 9], boxes=[2, 3, 1])
    assert packed.total.item() == pytest.approx(padded.total.item(), abs=1e-6)
    assert packed.terms == pytest.approx(padded.terms, abs=1e-6)
    assert packed.counts == padded.counts == {"num_ce_tokens": 17, "num_coord_tokens": 24, "num_bbox_slots": 6}


@settings(max_examples=8, deadline=None)
@given(
    st.integers(0, 10_000),
    st.lists(st.tuples(st.integers(1, 4), st.integers(4, 14), st.integers(0, 1)), min_size=1, max_size=3),
)
def test_packing_equivalence_holds_for_random_layouts(seed, layout):
    prompt_lens, assistant_lens, boxes = (list(x) for x in zip(*layout, strict=True))
    packed, padded = _packed_vs_unpacked(seed, prompt_lens, assistant_lens, boxes)
    assert packed.total.item() == pytest.approx(padded.total.item(), abs=1e-5)


# ------------------------------------------------------------------ ranks == one process (decision 19)


def _ranks_vs_one_process(seed: int, layout: list[tuple[int, int, int]], split: int, ranks_counts: bool):
    """Segments ``[:split]`` on rank 0 and the rest on rank 1 (one padded row each), against all of them in one
    batch. The ranks' losses and gradients are averaged, as DDP and ZeRO average gradients; with ``ranks_counts``
    each rank divides by the counts summed over both ranks (``ranks=2``, the trainer's reduction), else by its own."""
    from dataclasses import replace

    from coordexp.runtime.model.losses import LossDenominators

    rng = np.random.default_rng(seed)
    segs = [_random_segment(rng, n, k) for _, n, k in layout]
    seq_len = max(p + n for p, n, _ in layout) + 1
    logits = torch.randn(len(segs), seq_len, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    pipe = make_pipeline(coord_reg={"config": {"coord_ce_weight": 0.5, "text_gate_weight": 0.3}})

    def batch(indices: range) -> SupervisionBatch:
        return SupervisionBatch.from_segments(
            [SupervisionSegment(segs[i][0], segs[i][1], row, layout[i][0]) for row, i in enumerate(indices)], seq_len)

    whole_logits = logits.clone().requires_grad_(True)
    whole = compute_objective(whole_logits, batch(range(len(segs))), COORD_IDS, pipe)
    whole.total.backward()
    parts = [range(split), range(split, len(segs))]
    own = [LossDenominators.of(batch(part)) for part in parts]
    rank1 = []  # what rank 1 contributes to the all-reduce, as the trainer's collective would see it
    own[1].over_ranks(lambda counts: rank1.extend(counts) or counts, 1)
    summed = own[0].over_ranks(lambda counts: [a + b for a, b in zip(counts, rank1, strict=True)], 2)
    assert summed == replace(own[0] + own[1], ranks=2)
    rank_logits = [logits[part.start:part.stop].clone().requires_grad_(True) for part in parts]
    results = [compute_objective(rank_logits[r], batch(parts[r]), COORD_IDS, pipe, summed if ranks_counts else own[r])
               for r in (0, 1)]
    mean = (results[0].total + results[1].total) / 2
    mean.backward()
    grad = torch.cat([g.grad for g in rank_logits])  # the averaged gradient on each rank's logits
    terms = {k: (results[0].terms[k] + results[1].terms[k]) / 2 for k in whole.terms}  # the logged mean over ranks
    return whole, whole_logits.grad, float(mean.detach()), grad, terms


@settings(max_examples=10, deadline=None)
@given(
    st.integers(0, 10_000),
    st.lists(st.tuples(st.integers(1, 4), st.integers(8, 14), st.integers(0, 2)), min_size=2, max_size=4),
    st.data(),
)
def test_ranks_dividing_by_the_counts_of_all_ranks_average_to_one_process(seed, layout, data):
    """Stage 1's and stage 2's SFT terms under DDP or ZeRO: two ranks holding different numbers of text and
    coordinate tokens average to the one process at the global batch, term by term and in the gradient."""
    split = data.draw(st.integers(1, len(layout) - 1))
    whole, whole_grad, loss, grad, terms = _ranks_vs_one_process(seed, layout, split, ranks_counts=True)
    assert loss == pytest.approx(float(whole.total.detach()), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-4, atol=1e-7)
    assert terms == pytest.approx(whole.terms, rel=1e-5, abs=1e-6)


def test_ranks_dividing_by_their_own_counts_do_not_average_to_one_process():
    """The per-rank token mean used before: a rank of one short target weighs as much as a rank of three long ones."""
    layout = [(2, 14, 2), (3, 12, 2), (1, 13, 2), (2, 5, 0)]
    whole, whole_grad, loss, grad, _ = _ranks_vs_one_process(11, layout, 3, ranks_counts=False)
    assert loss != pytest.approx(float(whole.total.detach()), rel=1e-2)
    assert not torch.allclose(grad, whole_grad, rtol=1e-3, atol=1e-6)
    whole, whole_grad, loss, grad, _ = _ranks_vs_one_process(11, layout, 3, ranks_counts=True)
    assert loss == pytest.approx(float(whole.total.detach()), rel=1e-5)


def test_gate_terms_do_not_depend_on_which_other_gate_is_enabled():
    torch.manual_seed(5)
    sup = supervision(ce_pos=[0, 2], coord_pos=[1, 3], targets=[5.0, 9.0])
    ids = [3, coord_id(5), 4, coord_id(9)]
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, ids, 0, 1)], seq_len=5)
    logits = torch.randn(1, 5, VOCAB) * 3

    def gates(gate_w: float, text_w: float) -> dict:
        pipe = make_pipeline(coord_reg={"config": {"coord_gate_weight": gate_w, "text_gate_weight": text_w}})
        return compute_objective(logits, batch, COORD_IDS, pipe).terms

    both, gate_only, text_only = gates(1.0, 1.0), gates(1.0, 0.0), gates(0.0, 1.0)
    assert "coord_reg/text_gate" not in gate_only and "coord_reg/gate" not in text_only
    assert gate_only["coord_reg/gate"] == pytest.approx(both["coord_reg/gate"], abs=1e-6)
    assert text_only["coord_reg/text_gate"] == pytest.approx(both["coord_reg/text_gate"], abs=1e-6)
    expected_text = text_gate_loss(logits[0, [0, 2]], COORD_IDS, 1.0).mean().item()
    assert both["coord_reg/text_gate"] == pytest.approx(expected_text, abs=1e-6)


def test_objective_is_invariant_to_where_coord_ids_sit_in_the_vocabulary():
    rng = np.random.default_rng(11)
    sup, ids = _random_segment(rng, n_assistant=14, n_boxes=2)
    logits = torch.randn(1, 16, VOCAB) * 2
    perm = torch.from_numpy(rng.permutation(VOCAB))  # old id j -> new id perm[j]; coord ids become scattered
    moved = torch.empty_like(logits)
    moved[..., perm] = logits
    pipe = make_pipeline(coord_reg={"config": {"coord_ce_weight": 1.0, "text_gate_weight": 0.5}})
    original = compute_objective(
        logits, SupervisionBatch.from_segments([SupervisionSegment(sup, ids, 0, 2)], 16), COORD_IDS, pipe
    )
    moved_ids = perm[torch.tensor(ids)].tolist()
    relabelled = compute_objective(
        moved, SupervisionBatch.from_segments([SupervisionSegment(sup, moved_ids, 0, 2)], 16), perm[COORD_IDS], pipe
    )
    assert relabelled.terms == pytest.approx(original.terms, abs=1e-5)


# ------------------------------------------------------------------ chunked row statistics (memory: no (N, V) copy)


def _reference_row_stats(logits, index, coord_ids, temperatures, labels=None, **_unused) -> GatheredRowStats:
    """The plain path the chunked node replaces: gather, sanitise, then coord columns, logsumexps and labels."""
    fenced = sanitize_logits(logits.reshape(-1, logits.shape[-1]).index_select(0, index.to(logits.device)))
    labels = torch.zeros(0, dtype=torch.long) if labels is None else labels
    temps = dict.fromkeys(float(t) for t in temperatures)
    return GatheredRowStats(
        coord=coord_columns(fenced, coord_ids),
        lse={t: torch.logsumexp(fenced / t, dim=1) for t in temps},
        label_logit=fenced[: labels.numel()].gather(1, labels.unsqueeze(1)).squeeze(1),
    )


def _poisoned_logits(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Random logits with NaN, +/-inf and beyond-fence entries in several rows (some rows entirely bad)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * 2
    # Text ids get a head start so the coord mass stays moderate: near mass 1 the text gate -log(1 - mass)
    # amplifies float32 rounding ~1/(1 - mass) times, and two exact implementations differ beyond 1e-6.
    x[..., :NUM_TEXT] += 4.0
    flat = x.view(-1, shape[-1])
    flat[1, :40] = float("nan")
    flat[2, COORD_IDS[:300]] = float("inf")
    flat[3, :] = float("-inf")
    flat[4, 7], flat[4, 500], flat[5, 900] = 3e4, -2e4, float("inf")
    return x.to(dtype)


def _stats_outputs(stats: GatheredRowStats) -> list[torch.Tensor]:
    return [stats.coord, stats.label_logit, *stats.lse.values()]


def test_row_stats_gradient_is_exact_by_gradcheck_through_the_fences():
    logits = _poisoned_logits((2, 4, VOCAB), seed=1, dtype=torch.float64).requires_grad_(True)
    index = torch.tensor([4, 1, 6, 1, 2, 5, 3])  # repeated row 1; rows 1..5 hit every fence
    scattered = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:1000]
    for coord_ids in (COORD_IDS, scattered):

        def outputs(x, coord_ids=coord_ids):
            stats = gathered_row_stats(
                x, index, coord_ids, (1.0, 0.6), torch.tensor([3, 40, 5]), chunk_rows=3, compute_dtype=torch.float64
            )
            return tuple(_stats_outputs(stats))

        # fast mode checks random directional derivatives: the full Jacobian of 8k inputs would take minutes
        assert torch.autograd.gradcheck(outputs, (logits,), eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_row_stats_match_gather_then_sanitize_in_value_and_gradient(dtype, layout):
    raw = _poisoned_logits((2, 5, VOCAB), seed=4, dtype=dtype)
    if layout == "strided":  # a transposed view cannot be flattened: exercises the coordinate gather
        raw = raw.transpose(0, 1).contiguous().transpose(0, 1)
    index, labels = torch.tensor([7, 1, 2, 3, 9, 4, 5, 1]), torch.tensor([2, 1000, 17])
    results = []
    for build in (gathered_row_stats, _reference_row_stats):
        logits = raw.detach().clone() if layout == "contiguous" else raw.detach().clone().transpose(0, 1).contiguous()
        logits = (logits if layout == "contiguous" else logits.transpose(0, 1)).requires_grad_(True)
        outs = _stats_outputs(build(logits, index, COORD_IDS, (1.0, 2.5), labels, chunk_rows=3))
        upstream = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(outs)]
        sum((o * u).sum() for o, u in zip(outs, upstream, strict=True)).backward()
        results.append(([o.detach() for o in outs], logits.grad))
    (outs, grad), (ref_outs, ref_grad) = results
    for out, ref in zip(outs, ref_outs, strict=True):
        assert out.dtype == torch.float32 and torch.allclose(out, ref, rtol=1e-6, atol=1e-5)
    assert grad.dtype == dtype and grad.shape == raw.shape
    assert torch.allclose(grad.float(), ref_grad.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    assert torch.isfinite(grad).all() and grad[0, 1, :40].eq(0).all() and grad[0, 3].eq(0).all()


def test_row_stats_validate_their_inputs_with_clear_errors():
    logits = torch.zeros(1, 3, VOCAB)
    with pytest.raises(ValueError, match="row numbers in"):
        gathered_row_stats(logits, torch.tensor([3]), COORD_IDS, (1.0,))
    with pytest.raises(ValueError, match="ce label ids must lie in"):
        gathered_row_stats(logits, torch.tensor([0]), COORD_IDS, (1.0,), labels=torch.tensor([VOCAB]))
    with pytest.raises(ValueError, match="at most one token id per row"):
        gathered_row_stats(logits, torch.tensor([0]), COORD_IDS, (1.0,), labels=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="temperature"):
        gathered_row_stats(logits, torch.tensor([0]), COORD_IDS, (float("inf"),))


def _objective_and_grad(logits: torch.Tensor, batch: SupervisionBatch, pipe: PipelineConfig):
    logits = logits.detach().clone().requires_grad_(True)
    result = compute_objective(logits, batch, COORD_IDS, pipe)
    result.total.backward()
    return result, logits.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_objective_and_gradient_equal_the_plain_gather_sanitize_path(monkeypatch, temperature):
    rng = np.random.default_rng(21)
    sup, ids = _random_segment(rng, n_assistant=20, n_boxes=3)
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, ids, 1, 3)], seq_len=24)
    logits = _poisoned_logits((2, 24, VOCAB), seed=9)
    logits[1, 2:10] = logits.view(-1, VOCAB)[1:9]  # the poisoned rows become supervised rows of row 1
    pipe = make_pipeline(
        coord_reg={"config": {"coord_ce_weight": 0.5, "text_gate_weight": 0.3, "temperature": temperature}}
    )
    monkeypatch.setattr(coord_losses_module, "_CHUNK_ELEMENTS", 5 * VOCAB)  # several chunks per call
    chunked, chunked_grad = _objective_and_grad(logits, batch, pipe)
    monkeypatch.setattr(losses_module, "gathered_row_stats", _reference_row_stats)
    plain, plain_grad = _objective_and_grad(logits, batch, pipe)
    assert chunked.total.item() == pytest.approx(plain.total.item(), rel=1e-6, abs=1e-6)
    assert chunked.terms == pytest.approx(plain.terms, rel=1e-6, abs=1e-6)
    assert chunked.diagnostics == pytest.approx(plain.diagnostics, rel=1e-6, abs=1e-6)
    assert torch.allclose(chunked_grad, plain_grad, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(chunked_grad) > 0 and torch.isfinite(chunked_grad).all()


def test_objective_graph_saves_no_vocab_wide_tensor_but_the_logits_reference():
    """Autograd keeps only compact per-row tensors alive; the logits themselves are referenced, never copied."""
    rng = np.random.default_rng(3)
    sup, ids = _random_segment(rng, n_assistant=30, n_boxes=4)
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, ids, 0, 2)], seq_len=34)
    logits = torch.randn(1, 34, VOCAB, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    pipe = make_pipeline(coord_reg={"config": {"coord_ce_weight": 1.0, "text_gate_weight": 1.0}})
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        total = compute_objective(logits, batch, COORD_IDS, pipe).total
    wide = [t for t in saved if t.dim() >= 2 and t.shape[-1] == VOCAB]
    assert wide and all(t.data_ptr() == logits.data_ptr() and t.shape == logits.shape for t in wide)
    assert max(t.numel() for t in saved if t.data_ptr() != logits.data_ptr()) <= 34 * 1000
    total.backward()
    assert logits.grad.shape == logits.shape and torch.count_nonzero(logits.grad) > 0
