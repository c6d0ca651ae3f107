"""Matching: exact raster convention, maskIoU, top-k candidates, gating before assignment, dummy-augmented Hungarian."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.matching import (
    aabb_iou_matrix,
    assignment_matrix,
    candidate_mask,
    compute_match_costs,
    mask_iou_matrix,
    match_objects,
    rasterize,
)
from coordexp.runtime.core.objects import DetObject
from coordexp.schema.matching import MatchingConfig


def box(x1: int, y1: int, x2: int, y2: int, desc: str = "box") -> DetObject:
    return DetObject(desc, "bbox_2d", (x1, y1, x2, y2))


def poly(*coords: int, desc: str = "poly") -> DetObject:
    return DetObject(desc, "poly", tuple(coords))


def reference_mask(obj: DetObject, resolution: int) -> np.ndarray:
    """Per-pixel even-odd ray casting in exact rationals: the documented convention, written the slow obvious way."""
    pts = [
        (Fraction(min(max(int(x), 0), 999) * resolution, 1000), Fraction(min(max(int(y), 0), 999) * resolution, 1000))
        for x, y in obj.points()
    ]
    out = np.zeros((resolution, resolution), dtype=bool)
    for row in range(resolution):
        py = Fraction(2 * row + 1, 2)
        crossings = []
        for (x0, y0), (x1, y1) in zip(pts, pts[1:] + pts[:1]):
            if min(y0, y1) <= py < max(y0, y1):
                crossings.append(x0 + (py - y0) * (x1 - x0) / (y1 - y0))
        for col in range(resolution):
            out[row, col] = sum(x < Fraction(2 * col + 1, 2) for x in crossings) % 2 == 1
    return out


coord = st.integers(min_value=-60, max_value=1060)
shapes = st.one_of(
    st.tuples(coord, coord, coord, coord).map(lambda c: DetObject("b", "bbox_2d", c)),
    st.lists(st.tuples(coord, coord), min_size=3, max_size=7).map(
        lambda pts: DetObject("p", "poly", tuple(v for p in pts for v in p))
    ),
)


# ------------------------------------------------------------------------------------------------- raster


@settings(max_examples=60, deadline=None)
@given(objs=st.lists(shapes, min_size=1, max_size=3), resolution=st.sampled_from([8, 13, 24]))
def test_raster_equals_exact_even_odd_reference(objs, resolution):
    masks = rasterize(objs, resolution)
    assert masks.shape == (len(objs), resolution, resolution)
    for obj, mask in zip(objs, masks):
        np.testing.assert_array_equal(mask, reference_mask(obj, resolution))


def test_box_pixels_follow_centre_sampling_at_scale_r_over_1000():
    # [100, 200) at R=256 is canvas [25.6, 51.2): pixel centres 26.5 .. 50.5, i.e. 25 columns and rows.
    mask = rasterize([box(100, 100, 200, 200)], 256)[0]
    rows, cols = np.nonzero(mask)
    assert (rows.min(), rows.max(), cols.min(), cols.max()) == (26, 50, 26, 50)
    assert mask.sum() == 25 * 25


def test_self_intersecting_ring_uses_even_odd_fill():
    # A pentagram drawn as one ring: its inner pentagon is crossed twice, so even-odd leaves it empty.
    star = poly(500, 100, 735, 820, 120, 370, 880, 370, 265, 820)
    centre_pixel = rasterize([star], 100)[0][50, 50]
    assert not centre_pixel


def test_coords_are_clamped_before_rasterising():
    out_of_range = rasterize([box(-50, -20, 1200, 5000)], 64)[0]
    clamped = rasterize([box(0, 0, 999, 999)], 64)[0]
    np.testing.assert_array_equal(out_of_range, clamped)
    costs = compute_match_costs([box(-50, -20, 1200, 5000)], [box(0, 0, 999, 999)], MatchingConfig())
    assert costs.mask_iou[0, 0] == 1.0
    assert aabb_iou_matrix([box(-50, -20, 1200, 5000)], [box(0, 0, 999, 999)])[0, 0] == 1.0


def test_degenerate_shapes_are_empty_and_their_iou_is_zero():
    line_box = box(100, 100, 100, 300)
    collinear = poly(0, 0, 500, 500, 999, 999)
    masks = rasterize([line_box, collinear], 256)
    assert masks.sum() == 0
    costs = compute_match_costs([line_box, collinear], [line_box, collinear], MatchingConfig(maskiou_gate=0.0))
    np.testing.assert_array_equal(costs.mask_iou, 0.0)  # empty vs empty: 0 by definition, not NaN


def test_swapped_bbox_corners_are_the_same_rectangle():
    masks = rasterize([box(300, 400, 100, 200), box(100, 200, 300, 400)], 64)
    np.testing.assert_array_equal(masks[0], masks[1])
    assert masks[0].sum() > 0


def test_touching_shapes_share_no_pixel():
    left, right = box(100, 100, 200, 200), box(200, 100, 300, 200)
    masks = rasterize([left, right], 1000)
    assert not (masks[0] & masks[1]).any()
    assert masks[0].sum() == masks[1].sum() == 100 * 100


# ---------------------------------------------------------------------------------------------- mask IoU


def test_identical_shapes_have_mask_iou_one():
    shapes_ = [box(100, 120, 400, 380), poly(100, 100, 600, 150, 400, 700, 120, 500)]
    costs = compute_match_costs(shapes_, shapes_, MatchingConfig())
    assert costs.mask_iou[0, 0] == costs.mask_iou[1, 1] == 1.0


def test_half_overlap_boxes_hand_computed_and_close_to_analytic():
    a, b = box(100, 100, 200, 200), box(150, 100, 250, 200)
    # R=256: a covers columns 26..50 (25), b 38..63 (26), both 38..50 (13); rows equal -> IoU 13 / 38.
    at_256 = compute_match_costs([a], [b], MatchingConfig())
    assert at_256.mask_iou[0, 0] == pytest.approx(13 / 38, abs=1e-12)
    # R=1000: one pixel per norm1000 unit, so the raster IoU is the continuous one, 50 * 100 / (150 * 100).
    at_1000 = compute_match_costs([a], [b], MatchingConfig(maskiou_resolution=1000))
    assert at_1000.mask_iou[0, 0] == pytest.approx(1 / 3, abs=1e-12)
    assert abs(at_256.mask_iou[0, 0] - 1 / 3) < 0.02


def test_triangle_against_its_bbox_is_about_one_half():
    tri, bbox = poly(100, 100, 200, 100, 100, 200), box(100, 100, 200, 200)
    iou = compute_match_costs([tri], [bbox], MatchingConfig()).mask_iou[0, 0]
    expected = reference_mask(tri, 256).sum() / reference_mask(bbox, 256).sum()  # triangle lies inside the box
    assert iou == pytest.approx(expected, abs=1e-12)
    assert abs(iou - 0.5) < 0.03


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preds=st.lists(shapes, min_size=1, max_size=4), gts=st.lists(shapes, min_size=1, max_size=4))
def test_candidate_mask_iou_equals_dense_mask_iou(preds, gts):
    cfg = MatchingConfig(maskiou_resolution=32, candidate_top_k=10)
    costs = compute_match_costs(preds, gts, cfg)
    dense = mask_iou_matrix(rasterize(preds, 32), rasterize(gts, 32))
    np.testing.assert_allclose(costs.mask_iou, dense, atol=1e-6)


# -------------------------------------------------------------------------------------------- candidates


def test_candidates_rank_by_aabb_iou_then_fill_by_centre_distance():
    pred = box(100, 100, 200, 200)
    gts = [
        box(800, 800, 900, 900),  # far
        box(150, 150, 250, 250),  # overlaps (IoU 1/7)
        box(300, 100, 400, 200),  # no overlap, centre 200 away
        box(100, 300, 200, 400),  # no overlap, centre 200 away (tie with index 2)
        box(110, 110, 190, 190),  # overlaps most (IoU 0.64)
    ]
    aabbs_p = np.array([[100, 100, 200, 200]])
    aabbs_g = np.array([g.coords for g in gts])
    assert candidate_mask(aabbs_p, aabbs_g, 1)[0].tolist() == [False, False, False, False, True]
    assert candidate_mask(aabbs_p, aabbs_g, 2)[0].tolist() == [False, True, False, False, True]
    # Fewer than k overlap: the nearest centre fills, ties by GT index (2 before 3).
    assert candidate_mask(aabbs_p, aabbs_g, 3)[0].tolist() == [False, True, True, False, True]
    assert candidate_mask(aabbs_p, aabbs_g, 4)[0].tolist() == [False, True, True, True, True]
    result = match_objects([pred], gts, MatchingConfig(candidate_top_k=3))
    assert result.n_candidates == 3


def test_all_zero_aabb_iou_falls_back_to_nearest_centres():
    aabbs_p = np.array([[0, 0, 10, 10]])
    aabbs_g = np.array([[500, 500, 510, 510], [100, 0, 110, 10], [0, 50, 10, 60], [0, 100, 10, 110]])
    # Centre distances: 500*sqrt2, 100, 50, 100 -> nearest is 2, then the tie 1 vs 3 goes to index 1.
    assert candidate_mask(aabbs_p, aabbs_g, 2)[0].tolist() == [False, True, True, False]


def reference_candidate_mask(pred_aabbs: np.ndarray, gt_aabbs: np.ndarray, top_k: int) -> np.ndarray:
    """The documented ranking written the obvious way: sort each row by (IoU desc, centre distance asc, index)."""
    mask = np.zeros((len(pred_aabbs), len(gt_aabbs)), dtype=bool)
    for i, p in enumerate(pred_aabbs.tolist()):
        def rank(j: int, p=p) -> tuple[float, float, int]:
            g = gt_aabbs[j].tolist()
            dist2 = (p[0] + p[2] - g[0] - g[2]) ** 2 + (p[1] + p[3] - g[1] - g[3]) ** 2
            return -_float_aabb_iou(p, g), float(dist2), j

        mask[i, sorted(range(len(gt_aabbs)), key=rank)[:top_k]] = True
    return mask


def _float_aabb_iou(a: list, b: list) -> float:
    a, b = [float(v) for v in a], [float(v) for v in b]
    iw = max(min(a[2], b[2]) - max(a[0], b[0]), 0.0)
    ih = max(min(a[3], b[3]) - max(a[1], b[1]), 0.0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - iw * ih
    return iw * ih / union if union > 0 else 0.0


small_box = st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 3), st.integers(0, 3)).map(
    lambda t: (t[0] * 50, t[1] * 50, t[0] * 50 + t[2] * 50, t[1] * 50 + t[3] * 50)
)


@settings(max_examples=80, deadline=None)
@given(
    preds=st.lists(small_box, min_size=1, max_size=6),
    gts=st.lists(small_box, min_size=1, max_size=12),
    top_k=st.integers(1, 12),
    as_float=st.booleans(),
)
def test_candidate_mask_equals_the_full_ranking_with_ties(preds, gts, top_k, as_float):
    # A coarse grid makes IoU ties, zero-IoU rows and equal centre distances common (the tie-breaking paths).
    dtype = np.float64 if as_float else np.int64
    pred_aabbs, gt_aabbs = np.array(preds, dtype=dtype), np.array(gts, dtype=dtype)
    if as_float:
        pred_aabbs[:, 2:] += 0.25  # non-integer centres: the exact-key shortcut must not apply
    got = candidate_mask(pred_aabbs, gt_aabbs, top_k)
    np.testing.assert_array_equal(got, reference_candidate_mask(pred_aabbs, gt_aabbs, top_k))
    assert (got.sum(axis=1) == min(top_k, len(gts))).all()


def test_non_candidates_are_infeasible_even_with_high_mask_iou():
    pred = box(100, 100, 300, 300)
    gts = [box(100, 100, 300, 300), box(110, 110, 300, 300)]
    costs = compute_match_costs([pred], gts, MatchingConfig(candidate_top_k=1))
    assert costs.candidate[0].tolist() == [True, False]
    assert costs.feasible[0].tolist() == [True, False]
    assert costs.mask_iou[0, 1] == 0.0  # never computed


# ------------------------------------------------------------------------------------ gating and assignment


def test_spec_scenario_gating_makes_every_gt_fn_and_the_pred_fp():
    pred = box(100, 100, 200, 200)
    gts = [box(150, 150, 400, 400), box(600, 600, 700, 700), poly(180, 180, 260, 180, 260, 260)]
    cfg = MatchingConfig()
    costs = compute_match_costs([pred], gts, cfg)
    assert (costs.mask_iou[0] < cfg.maskiou_gate).all()
    assert not costs.feasible.any()  # every pred -> gt edge is infeasible before assignment
    result = match_objects([pred], gts, cfg)
    assert result.pairs == ()
    assert result.fp_pred_indices == (0,)
    assert result.fn_gt_indices == (0, 1, 2)
    assert result.gating_rejections == 3 == result.n_candidates


def test_pair_below_gate_is_never_matched_even_when_it_is_the_only_option_and_dummies_are_expensive():
    pred, gt = box(100, 100, 200, 200), box(150, 100, 250, 200)  # maskIoU 0.342
    cfg = MatchingConfig(maskiou_gate=0.5, fp_cost=100.0, fn_cost=100.0)
    result = match_objects([pred], [gt], cfg)
    assert result.pairs == () and result.fp_pred_indices == (0,) and result.fn_gt_indices == (0,)
    assert result.gating_rejections == 1
    # The same pair passes a lower gate.
    assert match_objects([pred], [gt], MatchingConfig(maskiou_gate=0.3)).pairs == ((0, 0),)


def test_mask_iou_equal_to_gate_is_feasible():
    pred, gt = box(100, 100, 200, 200), box(150, 100, 250, 200)
    cfg = MatchingConfig(maskiou_resolution=1000, maskiou_gate=1 / 3)
    assert match_objects([pred], [gt], cfg).pairs == ((0, 0),)


def _brute_force_optimum(matrix: np.ndarray) -> float:
    n = len(matrix)
    return min(sum(matrix[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n)))


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n_pred=st.integers(1, 3),
    n_gt=st.integers(1, 3),
    fp=st.floats(0.0, 5.0),
    fn=st.floats(0.0, 5.0),
)
def test_infeasible_cost_is_never_part_of_an_optimal_assignment(data, n_pred, n_gt, fp, fn):
    cost = np.array(data.draw(st.lists(st.floats(0.0, 1.0), min_size=n_pred * n_gt, max_size=n_pred * n_gt)))
    feasible = np.array(data.draw(st.lists(st.booleans(), min_size=n_pred * n_gt, max_size=n_pred * n_gt)))
    cost, feasible = cost.reshape(n_pred, n_gt), feasible.reshape(n_pred, n_gt)
    matrix = assignment_matrix(cost, feasible, fp, fn)
    assert np.isfinite(matrix).all()
    best = _brute_force_optimum(matrix)
    # Every assignment that uses an infeasible pair is strictly worse than the optimum.
    for perm in itertools.permutations(range(n_pred + n_gt)):
        uses_infeasible = any(i < n_pred and perm[i] < n_gt and not feasible[i, perm[i]] for i in range(n_pred))
        if uses_infeasible:
            assert sum(matrix[i, perm[i]] for i in range(n_pred + n_gt)) > best + 1e-9


def test_hungarian_finds_the_global_optimum_not_the_greedy_one():
    # IoUs: p0-g0 0.9, p0-g1 0.89, p1-g0 1.0, p1-g1 0.8 (gated). Greedy in pred order gives p0 its best GT 0
    # and leaves p1 with nothing; the optimum matches both.
    gts = [box(100, 100, 300, 300), box(100, 100, 260, 300)]
    preds = [box(100, 100, 280, 300), box(100, 100, 300, 300)]
    result = match_objects(preds, gts, MatchingConfig(maskiou_gate=0.85))
    assert result.pairs == ((0, 1), (1, 0))
    assert result.fn_gt_indices == () and result.fp_pred_indices == ()


def test_empty_inputs():
    cfg = MatchingConfig()
    gts = [box(1, 2, 30, 40), poly(10, 10, 50, 10, 30, 40)]
    none_pred = match_objects([], gts, cfg)
    assert none_pred.pairs == () and none_pred.fn_gt_indices == (0, 1) and none_pred.fp_pred_indices == ()
    none_gt = match_objects(gts, [], cfg)
    assert none_gt.pairs == () and none_gt.fp_pred_indices == (0, 1) and none_gt.fn_gt_indices == ()
    assert none_gt.gating_rejections == none_gt.n_candidates == 0
    assert match_objects([], [], cfg).pairs == ()


def test_malformed_geometry_fails_with_the_object_and_the_fix():
    with pytest.raises(ValueError, match=r"poly of object 'bad' has 5 coords; expected an even count >= 6"):
        match_objects([DetObject("bad", "poly", (1, 2, 3, 4, 5))], [box(1, 1, 2, 2)], MatchingConfig())
    with pytest.raises(ValueError, match=r"bbox_2d of object 'b' has 3 coords; expected exactly 4"):
        rasterize([DetObject("b", "bbox_2d", (1, 2, 3))], 16)


# ------------------------------------------------------------------------------------------------ properties

# Scenes of jittered copies: overlapping, partly gated, the shapes the trainer actually sees.
scene_shapes = st.one_of(
    st.tuples(st.integers(0, 800), st.integers(0, 800), st.integers(20, 199), st.integers(20, 199)).map(
        lambda t: box(t[0], t[1], t[0] + t[2], t[1] + t[3])
    ),
    st.tuples(st.integers(0, 800), st.integers(0, 800), st.integers(30, 199)).map(
        lambda t: poly(t[0], t[1], t[0] + t[2], t[1], t[0] + t[2] // 2, t[1] + t[2])
    ),
)


def _jitter(obj: DetObject, shift: int) -> DetObject:
    return DetObject(obj.desc, obj.geometry, tuple(min(999, v + shift) for v in obj.coords))


@st.composite
def scenes(draw):
    gts = draw(st.lists(scene_shapes, min_size=0, max_size=6))
    copies = [_jitter(g, draw(st.integers(0, 60))) for g in gts if draw(st.booleans())]
    preds = copies + draw(st.lists(scene_shapes, max_size=3))
    order = draw(st.permutations(range(len(preds))))
    return [preds[i] for i in order], gts


@settings(max_examples=80, deadline=None)
@given(scene=scenes(), gate=st.sampled_from([0.0, 0.3, 0.5]))
def test_match_result_is_a_partition_and_respects_the_gate(scene, gate):
    preds, gts = scene
    cfg = MatchingConfig(maskiou_gate=gate, maskiou_resolution=64, candidate_top_k=3)
    result = match_objects(preds, gts, cfg)
    costs = compute_match_costs(preds, gts, cfg)
    matched_p = [p for p, _ in result.pairs]
    matched_g = [g for _, g in result.pairs]
    assert sorted(matched_p + list(result.fp_pred_indices)) == list(range(len(preds)))
    assert sorted(matched_g + list(result.fn_gt_indices)) == list(range(len(gts)))
    assert list(result.pairs) == sorted(result.pairs)
    assert list(result.fn_gt_indices) == sorted(result.fn_gt_indices)
    for p, g in result.pairs:
        assert costs.candidate[p, g] and costs.mask_iou[p, g] >= gate
    assert result.gating_rejections == int((costs.candidate & (costs.mask_iou < gate)).sum())
    assert result.n_candidates == len(preds) * min(3, len(gts))
    assert match_objects(preds, gts, cfg) == result  # deterministic


def _total_cost(result, costs, cfg) -> float:
    return (
        sum(1.0 - costs.mask_iou[p, g] for p, g in result.pairs)
        + cfg.fp_cost * len(result.fp_pred_indices)
        + cfg.fn_cost * len(result.fn_gt_indices)
    )


def _optimal_pair_sets(costs, cfg) -> list[frozenset]:
    """All optimal sets of feasible pairs, by enumeration (small scenes only)."""
    feasible = list(zip(*np.nonzero(costs.feasible)))
    n_pred, n_gt = costs.feasible.shape
    best, argbest = None, []
    for k in range(min(n_pred, n_gt) + 1):
        for chosen in itertools.combinations(feasible, k):
            if len({p for p, _ in chosen}) < k or len({g for _, g in chosen}) < k:
                continue
            total = sum(1.0 - costs.mask_iou[p, g] for p, g in chosen) + cfg.fp_cost * (n_pred - k) + cfg.fn_cost * (n_gt - k)
            if best is None or total < best - 1e-12:
                best, argbest = total, [frozenset(chosen)]
            elif abs(total - best) <= 1e-12:
                argbest.append(frozenset(chosen))
    return argbest


@settings(max_examples=50, deadline=None)
@given(scene=scenes(), data=st.data())
def test_permuting_gt_order_permutes_the_result_when_the_optimum_is_unique(scene, data):
    preds, gts = scene
    cfg = MatchingConfig(maskiou_resolution=64, candidate_top_k=10)  # >= len(gts): candidates are order-free
    costs = compute_match_costs(preds, gts, cfg)
    result = match_objects(preds, gts, cfg)
    optima = _optimal_pair_sets(costs, cfg)
    assert frozenset(result.pairs) in optima  # Hungarian is optimal
    perm = data.draw(st.permutations(range(len(gts))))  # new position k holds old GT perm[k]
    permuted = match_objects(preds, [gts[i] for i in perm], cfg)
    assert _total_cost(permuted, compute_match_costs(preds, [gts[i] for i in perm], cfg), cfg) == pytest.approx(
        _total_cost(result, costs, cfg)
    )
    if len(optima) == 1:
        assert sorted((p, perm[g]) for p, g in permuted.pairs) == list(result.pairs)
        assert sorted(perm[g] for g in permuted.fn_gt_indices) == list(result.fn_gt_indices)
        assert permuted.fp_pred_indices == result.fp_pred_indices
